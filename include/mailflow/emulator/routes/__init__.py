"""The emulator's endpoint groups, one module each: sending, reading, the control API."""
