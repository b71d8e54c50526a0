"""Running untrusted generated code in isolation."""
