"""Command-line tools (``mm-opt``); kept apart so the library never imports them."""
