"""Test helpers: tiny models (``helpers.models``) and engine runners (``helpers.engine``)."""
