"""One router per resource; `app.py` mounts them under `/v1`."""
