"""The made-up tools of the chat fine-tune: each an OpenAI function definition, a way to draw a user request
with the arguments that fit the function's JSON schema, a result the tool might return, and a short answer
that reports the result."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

NAMES = (
    "Elizabeth",
    "Jane",
    "Darcy",
    "Bingley",
    "Emma",
    "Harriet",
    "Knightley",
    "Anne",
    "Wentworth",
    "Fanny",
    "Edmund",
    "Elinor",
    "Marianne",
    "Catherine",
    "Henry",
    "Lydia",
    "Mary",
    "Kitty",
)
PLACES = (
    "Bath",
    "London",
    "Highbury",
    "Pemberley",
    "Bristol",
    "Lyme",
    "Brighton",
    "Kellynch",
    "Mansfield",
    "Netherfield",
    "Hartfield",
    "Portsmouth",
    "Oxford",
    "York",
    "Derby",
    "Longbourn",
    "Norland",
    "Barton",
)
BOOKS = (
    "Emma",
    "Persuasion",
    "Pride and Prejudice",
    "Sense and Sensibility",
    "Mansfield Park",
    "Northanger Abbey",
)
YEARS = {
    "Emma": 1815,
    "Persuasion": 1817,
    "Pride and Prejudice": 1813,
    "Sense and Sensibility": 1811,
    "Mansfield Park": 1814,
    "Northanger Abbey": 1817,
}
BIBLE = ("Genesis", "Exodus", "Psalms", "Proverbs", "Isaiah", "Matthew", "John", "Romans", "Ruth")
SKIES = ("rain", "sun", "fog", "snow", "wind", "cloud")
ERRANDS = (
    "walk to the village",
    "call on Mrs. Bates",
    "write to my sister",
    "visit the library",
    "dine with the Westons",
    "read to my father",
)
MESSAGES = (
    "I shall come on Tuesday",
    "we are all well at home",
    "the ball is on Friday",
    "thank you for the letter",
    "do not wait for me",
    "the carriage is ready",
)


@dataclass(frozen=True)
class ToolUse:
    """One request for a tool: what the user says, the call's arguments, the result and the reply."""

    request: str
    arguments: dict[str, Any]
    result: dict[str, Any]
    answer: str
    purpose: str  # what the user wants, for the reasoning: "the weather in Bath"


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    properties: dict[str, dict[str, Any]]
    required: tuple[str, ...]
    draw: Callable[[random.Random], ToolUse]

    def definition(self) -> dict[str, Any]:
        schema = {"type": "object", "properties": self.properties, "required": list(self.required)}
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": schema},
        }


def _weather(rng: random.Random) -> ToolUse:
    city, sky, degrees = rng.choice(PLACES), rng.choice(SKIES), rng.randint(-2, 28)
    result = {"city": city, "sky": sky, "temperature": degrees}
    answer = f"In {city} there is {sky}, and it is {degrees} degrees."
    if rng.random() < 0.4:
        days = rng.randint(2, 7)
        request = rng.choice(
            ("What weather will {c} have for {d} days?", "Tell me the weather in {c} for {d} days.")
        )
        return ToolUse(
            request.format(c=city, d=days),
            {"city": city, "days": days},
            result,
            answer,
            f"the weather in {city} for {days} days",
        )
    request = rng.choice(
        ("What is the weather in {c}?", "Is it raining in {c}?", "How is the weather at {c} today?")
    )
    return ToolUse(request.format(c=city), {"city": city}, result, answer, f"the weather in {city}")


def _book(rng: random.Random) -> ToolUse:
    title = rng.choice(BOOKS)
    request = rng.choice(("Find the book {t}.", "Who wrote {t}?", "When was {t} printed?"))
    result = {"title": title, "author": "Jane Austen", "year": YEARS[title]}
    answer = f"{title} was written by Jane Austen and printed in {YEARS[title]}."
    return ToolUse(request.format(t=title), {"title": title}, result, answer, f"the book {title}")


def _letter(rng: random.Random) -> ToolUse:
    name, text = rng.choice(NAMES), rng.choice(MESSAGES)
    request = rng.choice(("Write to {n} and say that {m}.", "Send a letter to {n}: {m}."))
    args, answer = {"to": name, "text": text}, f"The letter to {name} is sent."
    return ToolUse(request.format(n=name, m=text), args, {"sent": True}, answer, f"a letter sent to {name}")


def _add(rng: random.Random) -> ToolUse:
    a, b = rng.randint(2, 999), rng.randint(2, 999)
    request = rng.choice(("What is {a} plus {b}?", "Add {a} and {b}.", "How much are {a} and {b} together?"))
    answer = f"{a} and {b} make {a + b}."
    return ToolUse(
        request.format(a=a, b=b), {"a": a, "b": b}, {"sum": a + b}, answer, f"the sum of {a} and {b}"
    )


def _verse(rng: random.Random) -> ToolUse:
    book, chapter, verse = rng.choice(BIBLE), rng.randint(1, 30), rng.randint(1, 20)
    request = rng.choice(("Read me {b} {c}:{v}.", "What does {b} chapter {c} verse {v} say?"))
    text = "In the beginning was the Word." if rng.random() < 0.5 else "The Lord is my shepherd."
    place = f"{book} {chapter}:{verse}"
    args = {"book": book, "chapter": chapter, "verse": verse}
    answer = f"{place} says: {text}"
    return ToolUse(
        request.format(b=book, c=chapter, v=verse), args, {"text": text}, answer, f"the verse {place}"
    )


def _reminder(rng: random.Random) -> ToolUse:
    hour, errand = rng.randint(1, 12), rng.choice(ERRANDS)
    request = rng.choice(("Remind me at {h} o'clock to {e}.", "At {h}, tell me to {e}."))
    answer = f"I will remind you at {hour} o'clock to {errand}."
    args = {"note": errand, "hour": hour}
    purpose = f"a reminder at {hour} o'clock"
    return ToolUse(request.format(h=hour, e=errand), args, {"ok": True}, answer, purpose)


def _str(description: str) -> dict[str, Any]:
    return {"type": "string", "description": description}


def _int(description: str) -> dict[str, Any]:
    return {"type": "integer", "description": description}


TOOLS = (
    Tool(
        "get_weather",
        "Get the weather of a town.",
        {"city": _str("The town"), "days": _int("Days ahead")},
        ("city",),
        _weather,
    ),
    Tool("find_book", "Find a book by its title.", {"title": _str("The title")}, ("title",), _book),
    Tool(
        "send_letter",
        "Send a letter.",
        {"to": _str("Who gets it"), "text": _str("What it says")},
        ("to", "text"),
        _letter,
    ),
    Tool(
        "add_numbers",
        "Add two numbers.",
        {"a": {"type": "number"}, "b": {"type": "number"}},
        ("a", "b"),
        _add,
    ),
    Tool(
        "read_verse",
        "Read a Bible verse.",
        {"book": _str("The book"), "chapter": _int("Chapter"), "verse": _int("Verse")},
        ("book", "chapter", "verse"),
        _verse,
    ),
    Tool(
        "set_reminder",
        "Set a reminder.",
        {"note": _str("What to do"), "hour": _int("The hour")},
        ("note", "hour"),
        _reminder,
    ),
)
