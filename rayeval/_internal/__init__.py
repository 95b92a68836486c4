"""rayeval's machinery: nothing here is public API."""
