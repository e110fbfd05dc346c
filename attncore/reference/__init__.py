"""The pure-torch reference backend."""
