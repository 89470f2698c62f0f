"""Structured outputs: grammars (xgrammar) compiled once, matched per request, masking the sampler's logits.

A request's matcher follows its output tokens: before each mask is filled it accepts the tokens it has
not seen yet, and rolls back any the engine has cut (a rejected draft), so it needs no hook at append
time and survives preemption (the output tokens are kept, so the matcher stays where it was).
``fill_bitmask`` also fills masks for draft positions (speculative decoding): drafts are accepted
tentatively and rolled back afterwards.
"""

from __future__ import annotations

import importlib
import json
import logging
import re
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch

from hybridserve.engine.errors import RequestRejected
from hybridserve.engine.request import Request, StructuredOutputsParams

log = logging.getLogger("hybridserve.engine")


class _OnFirstUse:
    """A module imported when first touched: xgrammar pulls in transformers (seconds at start-up), which
    a server whose requests never ask for structured outputs does not pay."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._module: ModuleType | None = None

    def __getattr__(self, attr: str) -> Any:
        if self._module is None:
            self._module = importlib.import_module(self._name)
        return getattr(self._module, attr)


if TYPE_CHECKING:
    import xgrammar as xgr
else:
    xgr = _OnFirstUse("xgrammar")

MAX_SPEC_CHARS = 64 << 10  # longest schema / regex / grammar text accepted
MAX_CACHED_GRAMMARS = 256


def grammar_key(spec: StructuredOutputsParams) -> tuple[str, str]:
    """(kind, text): what identifies a compiled grammar."""
    if spec.json is not None:
        text = spec.json if isinstance(spec.json, str) else json.dumps(spec.json)  # property order matters
        return "json", text
    if spec.regex is not None:
        return "regex", spec.regex
    if spec.choice is not None:
        return "grammar", _choice_grammar(spec.choice)
    if spec.grammar is not None:
        return "grammar", spec.grammar
    if spec.structural_tag is not None:
        return "structural_tag", spec.structural_tag
    return "json_object", ""


def _choice_grammar(choices: list[str]) -> str:
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def warm_grammar_checks() -> None:
    """Import xgrammar and build one grammar, so that the first ``check_spec`` (the API server's, on its
    event loop) costs what later ones do rather than xgrammar's ~1.3 s import."""
    _grammar_error("json_object", "")


def check_spec(spec: StructuredOutputsParams) -> None:
    """Raise RequestRejected (naming the problem) unless the constraint is a grammar xgrammar can build."""
    kind, text = grammar_key(spec)
    if len(text) > MAX_SPEC_CHARS:
        raise RequestRejected(
            f"the {kind} constraint is {len(text):,} characters; at most {MAX_SPEC_CHARS:,} are accepted",
            "invalid_structured_output",
            "structured_outputs",
        )
    error = _grammar_error(kind, text)
    if error is not None:
        raise RequestRejected(error, "invalid_structured_output", "structured_outputs")


@lru_cache(maxsize=MAX_CACHED_GRAMMARS)
def _grammar_error(kind: str, text: str) -> str | None:
    try:
        _grammar(kind, text)
    except Exception as exc:  # xgrammar raises RuntimeError / ValueError subclasses with a message
        return f"invalid {_NAMES[kind]}: {_reason(exc)}"
    return None


_NAMES = {
    "json": "JSON schema",
    "regex": "regex",
    "grammar": "grammar",
    "json_object": "JSON object",
    "structural_tag": "structural tag",
}
_LOCATION = re.compile(r"^\[[0-9:]+\] \S+:[0-9]+: ")  # xgrammar's "[07:15:46] /project/cpp/x.cc:94: "


def _reason(exc: Exception) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return _LOCATION.sub("", text)[:500]


def _grammar(kind: str, text: str) -> xgr.Grammar:
    if kind == "json":
        schema = json.loads(text)
        if not isinstance(schema, dict | bool):
            raise ValueError("a JSON schema must be an object or a boolean")
        return xgr.Grammar.from_json_schema(text, any_whitespace=False, strict_mode=True)
    if kind == "regex":
        return xgr.Grammar.from_regex(text)
    if kind == "grammar":
        return xgr.Grammar.from_ebnf(text)
    if kind == "structural_tag":
        return xgr.Grammar.from_structural_tag(text)
    return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)


def token_bytes(folder: str | Path) -> tuple[list[bytes], list[int]]:
    """Each token's bytes as the model emits them (special tokens: b""), and the special token ids."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders

    hf = HFTokenizer.from_file(str(Path(folder) / "tokenizer.json"))
    size = hf.get_vocab_size(with_added_tokens=True)
    added = hf.get_added_tokens_decoder()
    byte_level = isinstance(hf.decoder, decoders.ByteLevel)
    unbyte = {c: b for b, c in _bytes_to_unicode().items()}
    vocab: list[bytes] = []
    special: list[int] = []
    for tid in range(size):
        piece = hf.id_to_token(tid) or ""
        if tid in added:
            vocab.append(b"" if added[tid].special else piece.encode())
            special += [tid] if added[tid].special else []
        elif byte_level:
            vocab.append(
                bytes(unbyte[c] for c in piece) if all(c in unbyte for c in piece) else piece.encode()
            )
        else:
            vocab.append(_piece_bytes(piece))
    return vocab, special


def _piece_bytes(piece: str) -> bytes:
    """SentencePiece-style pieces: ``<0xNN>`` byte fallback, ``▁`` for a space."""
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        return bytes([int(piece[3:5], 16)])
    return piece.replace("▁", " ").encode()


@lru_cache(maxsize=1)
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: byte -> the printable character a byte-level vocabulary spells it with."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


@dataclass
class _Matched:
    request: weakref.ref[Request]
    matcher: xgr.GrammarMatcher
    num_accepted: int = 0  # output tokens the matcher has taken
    broken: bool = False  # a token the grammar refuses was appended: the request stops constraining


class StructuredOutputs:
    """The engine's grammars: a compiler over the model's vocabulary, compiled grammars (an LRU cache),
    one matcher per constrained request, and the masks they give."""

    def __init__(self, folder: str | Path, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        self.folder = str(folder)
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self._compiler: xgr.GrammarCompiler | None = None
        self.compiled: OrderedDict[tuple[str, str], xgr.CompiledGrammar] = OrderedDict()
        self.compile_count = 0
        self.compiler_builds = 0
        self._lock = threading.RLock()  # the start-up warm-up compiles beside the step loop
        self._matched: dict[str, _Matched] = {}

    # ---- grammars ---------------------------------------------------------------------------------
    def start_warm_up(self, import_in_thread: bool = False) -> threading.Thread | None:
        """Import xgrammar (seconds: it pulls in transformers), then build the compiler (the vocabulary's
        token table) and compile the JSON-object grammar (``warm_up``) in a background thread, at
        start-up: on the step loop they would stall every stream when the first constrained request
        came. A constrained request that comes sooner waits for the warm-up; None when there is no
        tokenizer.

        transformers' lazy module must not be imported by two threads at once, so xgrammar is imported
        here unless ``import_in_thread`` (an engine-core process of its own, where nothing else imports
        transformers)."""
        if not self.has_tokenizer:
            return None
        if not import_in_thread:
            xgr.GrammarCompiler  # noqa: B018
        thread = threading.Thread(target=self.warm_up, name="grammar-warm-up", daemon=True)
        thread.start()
        return thread

    @property
    def has_tokenizer(self) -> bool:
        return (Path(self.folder) / "tokenizer.json").is_file()

    def warm_up(self) -> None:
        try:
            self.compile(StructuredOutputsParams(json_object=True))
        except Exception:  # the first constrained request reports it, as before
            log.exception("could not warm up the grammar compiler")

    def compiler(self) -> xgr.GrammarCompiler:
        with self._lock:
            return self._compiler or self._build_compiler()

    def _build_compiler(self) -> xgr.GrammarCompiler:
        if self._compiler is None:
            if not self.has_tokenizer:
                raise RequestRejected(
                    "this model ships no tokenizer.json, so structured outputs are unavailable",
                    "invalid_structured_output",
                    "structured_outputs",
                )
            vocab, _ = token_bytes(self.folder)
            info = xgr.TokenizerInfo(
                vocab,
                vocab_type=xgr.VocabType.RAW,
                vocab_size=max(self.vocab_size, len(vocab)),
                stop_token_ids=self.stop_token_ids,
            )
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            self.compiler_builds += 1
        return self._compiler

    def compile(self, spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """The compiled grammar of ``spec`` (cached); RequestRejected naming the problem if it is invalid."""
        with self._lock:
            return self._compile(spec)

    def _compile(self, spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
        key = grammar_key(spec)
        if key in self.compiled:
            self.compiled.move_to_end(key)
            return self.compiled[key]
        check_spec(spec)
        kind, text = key
        try:
            compiled = self.compiler().compile_grammar(_grammar(kind, text))
        except Exception as exc:
            raise RequestRejected(
                f"cannot compile the {_NAMES[kind]}: {_reason(exc)}",
                "invalid_structured_output",
                "structured_outputs",
            ) from exc
        self.compile_count += 1
        self.compiled[key] = compiled
        if len(self.compiled) > MAX_CACHED_GRAMMARS:
            self.compiled.popitem(last=False)
        return compiled

    # ---- requests ---------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        spec = request.params.structured_outputs
        if spec is None:
            return
        matcher = xgr.GrammarMatcher(self.compile(spec))  # it can roll back any number of tokens
        self._matched[request.request_id] = _Matched(weakref.ref(request), matcher)

    def is_terminated(self, request: Request) -> bool:
        """Whether the request's grammar is complete (it accepted a stop token) and nothing may follow."""
        state = self._state(request)
        return state is not None and not state.broken and state.matcher.is_terminated()

    def constrained(self, requests: Sequence[Request]) -> list[int]:
        return [i for i, r in enumerate(requests) if r.params.structured_outputs is not None]

    def fill_bitmask(
        self, request: Request, bitmask: torch.Tensor, row: int, drafts: Sequence[int] = ()
    ) -> int:
        """Fill ``bitmask[row]`` with the tokens the grammar allows next, then one row more for each draft
        token (as if the ones before it were accepted); -> rows filled. Rows for drafts the grammar refuses,
        and rows of a request it no longer constrains, allow every token."""
        state = self._state(request)
        if state is None or state.broken or state.matcher.is_terminated():
            bitmask[row : row + len(drafts) + 1] = -1
            return len(drafts) + 1
        matcher, taken = state.matcher, 0
        for k in range(len(drafts) + 1):
            if taken < k or matcher.is_terminated():  # past a refused draft, or a draft that ended it
                bitmask[row + k] = -1
                continue
            matcher.fill_next_token_bitmask(bitmask, row + k)
            if k < len(drafts) and not matcher.is_terminated() and matcher.accept_token(drafts[k]):
                taken += 1
        if taken:
            matcher.rollback(taken)
        return len(drafts) + 1

    def apply(self, logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        """``logits`` with every token the rows' grammars refuse set to -inf (a copy), or ``logits`` itself
        when no row is constrained."""
        rows = self.constrained(requests)
        if not rows:
            return logits
        self.release_finished()
        bitmask = xgr.allocate_token_bitmask(len(rows), logits.shape[1])
        for k, i in enumerate(rows):
            self.fill_bitmask(requests[i], bitmask, k)
        allowed = unpack_bitmask(bitmask.to(logits.device), logits.shape[1])
        at = torch.tensor(rows, dtype=torch.long, device=logits.device)
        masked = logits.index_select(0, at).masked_fill(~allowed, float("-inf"))
        return logits.index_copy(0, at, masked)

    def release_finished(self) -> None:
        for request_id, state in list(self._matched.items()):
            req = state.request()
            if req is None or req.is_finished:
                del self._matched[request_id]

    def _state(self, request: Request) -> _Matched | None:
        """The request's matcher, brought up to date with its output tokens."""
        state = self._matched.get(request.request_id)
        if state is None or state.request() is not request:
            return None
        outputs = request.output_token_ids
        cut = state.num_accepted - len(outputs)
        if cut > 0 and state.broken:  # replay from the start
            state.matcher.reset()
            state.num_accepted, state.broken = 0, False
        elif cut > 0:  # tokens were cut (a rejected draft)
            state.matcher.rollback(cut)
            state.num_accepted = len(outputs)
        for token in outputs[state.num_accepted :]:
            if state.broken or state.matcher.is_terminated():
                break
            if not state.matcher.accept_token(token):
                log.warning(
                    "request %s: token %d breaks its grammar; unconstrained", request.request_id, token
                )
                state.broken = True
            state.num_accepted += 1
        return state


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [rows, words] bitmask (bit j of word w: token 32 w + j allowed) -> bool [rows, vocab_size]."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask[:, :, None] >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()
