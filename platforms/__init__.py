"""Platforms: the interface, plugin-provided platforms and resolution of the current one."""

from engine.platforms.interface import Platform

__all__ = ["Platform"]
