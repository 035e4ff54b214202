"""Live views of the engine's memory: page map, prefix tree, graphs, legend, queue.

Every view reads `EngineSnapshot`s and `Telemetry`; none calls the engine. The main
window embeds `memory_panel.MemoryPanel`, which holds them all. The page map's and the
prefix tree's models (`page_map_model`, `prefix_tree_model`) import no Qt, so this
package imports nothing itself: a model can be used and tested without Qt loaded.
"""
