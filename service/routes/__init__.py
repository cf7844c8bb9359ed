"""One router per resource: predictions, users, operations."""
