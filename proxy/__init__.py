"""specroute's proxy: the OpenAI-compatible HTTP front of the spec and base pools."""

__version__ = "0.1.0"
