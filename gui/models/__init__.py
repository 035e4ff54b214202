"""The Models window's tabs (gui/model_manager.py): Discover, Downloads, My models."""
