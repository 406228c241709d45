"""engine-llm-cpu: the CPU platform for the engine (always available; the fallback of last resort
is still an explicit, documented priority 0, never a silent substitute for a failed plugin)."""

__version__ = "0.1.0"
