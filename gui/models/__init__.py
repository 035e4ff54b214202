"""The Models window's tabs (gui/models_dialog.py): Discover, Downloads, My models."""
