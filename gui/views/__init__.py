"""Live views of the engine's memory: page map, prefix tree, graphs, legend, queue.

Every view reads `EngineSnapshot`s and `Telemetry`; none calls the engine. The main
window embeds `MemoryPanel`, which holds them all.
"""

from gui.views.graphs import ThroughputGraphs
from gui.views.legend import LegendBar
from gui.views.memory_panel import MemoryPanel
from gui.views.page_map import PageMapModel, PageMapView
from gui.views.prefix_tree import PrefixTreeView, TreeNode
from gui.views.queue_panel import QueuePanel

__all__ = [
    "LegendBar",
    "MemoryPanel",
    "PageMapModel",
    "PageMapView",
    "PrefixTreeView",
    "QueuePanel",
    "ThroughputGraphs",
    "TreeNode",
]
