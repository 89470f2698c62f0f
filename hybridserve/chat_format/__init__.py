"""Conversation formats written in code rather than as Jinja chat templates (DeepSeek-V4's encoder)."""
