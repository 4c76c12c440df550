"""Roundhouse configuration: one :class:`Settings` object, read once."""

from settings.celery import TASK_NAMES, celery_config
from settings.config import SandboxMode, Settings, get_settings

__all__ = ["TASK_NAMES", "SandboxMode", "Settings", "celery_config", "get_settings"]
