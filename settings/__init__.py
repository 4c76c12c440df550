"""Roundhouse configuration: one :class:`Settings` object, read once."""

from settings.config import MIB, SandboxMode, Settings, get_settings

__all__ = ["MIB", "SandboxMode", "Settings", "get_settings"]
