"""How a call reaches a kernel: the backend table, switches, call plans, launches."""
