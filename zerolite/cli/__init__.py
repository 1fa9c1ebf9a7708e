"""The zerolite command."""
