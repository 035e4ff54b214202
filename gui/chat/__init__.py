"""The chat side of the window: message bubbles, the chat view and the controller
that turns sends, edits and regenerations into engine jobs and saved messages."""
