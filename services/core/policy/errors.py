"""Policy errors name the field at fault, so the admin API can return a precise 400."""

from __future__ import annotations


class PolicyError(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message
