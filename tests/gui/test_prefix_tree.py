"""The prefix tree as people read it: labels that never overlap, chains folded into
stacks, tooltips in words, the chat template left out, and the "0 shared" of a system
prompt shorter than a page explained (offscreen, pytest-qt, no model).

`chat_cache` builds the snapshot a page table would show for a set of chats: pages
keyed by the whole prefix they end, so chats that begin alike share pages as content
hashing makes them."""

from __future__ import annotations

import dataclasses
import re
import time

import numpy as np
import pytest
from PySide6.QtCore import QPointF, QRect, QRectF, Qt
from PySide6.QtGui import QFontMetrics
from PySide6.QtWidgets import QApplication

from engine.cache.disk_tier import DiskTierSnapshot
from engine.cache.page import PageState
from engine.cache.snapshot import CacheSnapshot, cache_stats
from engine.engine import EngineSnapshot, JobInfo
from gui.views.prefix_tree import PrefixTreeView
from gui.views.prefix_tree_model import PrefixTreeModel
from gui.views.prefix_tree_text import readable_text, special_token_ids, state_in_words
from tests.gui.conftest import synthetic_snapshot

WRAP = int(Qt.TextFlag.TextWordWrap)
SYSTEM = "You are Folio, a careful assistant. Answer briefly and say so when unsure."


class ChatMLTokenizer:
    """Word-level ChatML: "<|im_start|>" and "<|im_end|>" are its special tokens, and
    every word (with its leading space) or line break is one token."""

    all_special_ids = (1, 2)

    def __init__(self) -> None:
        self._ids = {"<|im_start|>": 1, "<|im_end|>": 2}
        self._words = {1: "<|im_start|>", 2: "<|im_end|>"}

    def encode(self, text: str) -> list[int]:
        ids = []
        for word in re.findall(r"<\|[a-z_]+\|>|\n| ?[^\s<]+", text):
            if word not in self._ids:
                self._ids[word] = len(self._ids) + 1
                self._words[self._ids[word]] = word
            ids.append(self._ids[word])
        return ids

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return self.encode(text + "<|im_start|>assistant\n")

    def decode(self, ids: list[int]) -> str:
        return "".join(self._words[i] for i in ids)


@pytest.fixture
def chatml() -> ChatMLTokenizer:
    return ChatMLTokenizer()


def chat_cache(
    chats: list[tuple[str, list[int], bool]],
    page_size: int = 32,
    spare: int = 8,
    disk: list[tuple[int, int]] = (),
    version: int = 1,
) -> EngineSnapshot:
    """The snapshot of a cache holding ``chats``: (tag, prompt tokens, still running).
    A full page is keyed by the prefix it ends (as its content hash is), so chats that
    begin alike share it; a chat's last, partial page is its own. Finished chats' pages
    are cached, leaves first in the eviction order. ``disk``: (hash, parent hash)
    records of the disk tier."""
    pages: dict[tuple, int] = {}
    owners: list[set[int]] = []
    tokens: list[list[int]] = []
    parent: list[int] = []
    for seq, (_tag, ids, live) in enumerate(chats, start=1):
        before = -1
        for start in range(0, len(ids), page_size):
            chunk = ids[start : start + page_size]
            key = tuple(ids[: start + page_size]) if len(chunk) == page_size else (seq,)
            page = pages.get(key)
            if page is None:
                page = pages[key] = len(tokens)
                owners.append(set())
                tokens.append(list(chunk))
                parent.append(before)
            if live:
                owners[page].add(seq)
            before = page
    used = len(tokens)
    n = used + spare
    full = np.array([len(t) == page_size for t in tokens] + [False] * spare)
    ref = np.array([len(o) for o in owners] + [0] * spare, np.int32)
    fill = np.array([len(t) for t in tokens] + [0] * spare, np.int32)
    state = np.where(ref > 0, PageState.REFERENCED, np.where(fill > 0, PageState.CACHED, 0))
    prefix = np.zeros(n, np.uint64)
    for key, page in pages.items():
        if full[page]:
            prefix[page] = np.uint64(hash(key) % (2**62) + 1)
    parent_arr = np.array(parent + [-1] * spare, np.int32)
    kids = np.flatnonzero(parent_arr >= 0).astype(np.int32)
    has_child = np.zeros(n, bool)
    has_child[parent_arr[kids]] = True
    cached_leaves = [p for p in range(used) if state[p] == PageState.CACHED and not has_child[p]]
    records = None
    if disk:
        records = DiskTierSnapshot(
            np.array([h for h, _ in disk], np.uint64),
            np.array([p for _, p in disk], np.uint64),
            np.arange(len(disk), dtype=np.int64),
        )
    cache = CacheSnapshot(
        state=state.astype(np.uint8),
        ref_count=ref,
        fill=fill,
        tier=np.zeros(n, np.uint8),
        access_serial=np.arange(n, dtype=np.int64),
        owners=[tuple(sorted(o)) for o in owners] + [()] * spare,
        hash_prefix=prefix,
        edges=np.stack([kids, parent_arr[kids]], axis=1),
        host=None,
        counters={},
        disk_records=records,
    )
    live = [seq for seq, (_t, _i, on) in enumerate(chats, start=1) if on]
    jobs = [
        JobInfo(seq, chats[seq - 1][0], "decode", len(chats[seq - 1][1]), 0, 0, 0, "", (seq,), 1)
        for seq in live
    ]
    tags = {seq: chats[seq - 1][0] for seq in live}
    stats = cache_stats(cache, page_size)
    page_tokens = tokens + [[] for _ in range(spare)]
    evict = list(range(used, n)) + cached_leaves
    return EngineSnapshot(
        version, 0.0, cache, stats, page_size, n, page_tokens, evict, jobs,
        {seq: seq for seq in live}, tags, 0, 0,
    )  # fmt: skip


def _prompt(tok: ChatMLTokenizer, system: str, user: str) -> list[int]:
    return tok.encode_chat(
        [{"role": "system", "content": system}, {"role": "user", "content": user}]
    )


def _words(i: int, count: int) -> str:
    return " ".join(f"w{i}x{j}" for j in range(count))


def many_chats(tok: ChatMLTokenizer, chats: int, pages: int, page_size: int = 32):
    """``chats`` chats of about ``pages`` pages each, in pairs that share a long
    opening (a document pasted into both), all running."""
    out = []
    for i in range(chats):
        opening = _words(i // 2, page_size * pages // 2)
        ids = _prompt(tok, SYSTEM + " " + opening, _words(1000 + i, page_size * pages // 2))
        out.append((f"chat {i + 1}", ids, True))
    return out


def _tree(qtbot, snap, tokenizer, size=(700, 360)) -> PrefixTreeView:
    tree = PrefixTreeView()
    qtbot.addWidget(tree)
    tree.resize(*size)
    tree.show()
    qtbot.waitExposed(tree)
    tree.set_snapshot(snap, tokenizer)
    return tree


def _label_rects(tree: PrefixTreeView) -> list[QRectF]:
    """The shown labels' text rectangles in the view's pixels (labels ignore the zoom,
    so only the device transform says where they land)."""
    to_px = tree.plot.viewportTransform()
    rects = []
    for item in tree._labels.values():
        if item.isVisible():
            t = item.text_item
            rects.append(t.deviceTransform(to_px).mapRect(t.boundingRect()))
    return rects


def _node_rects(tree: PrefixTreeView) -> list[QRectF]:
    to_px = tree.plot.viewportTransform()
    vb = tree.plot.getViewBox()
    to_scene = vb.childTransform() * vb.sceneTransform()
    rects = []
    for pt in tree.scatter.points():
        at = to_px.map(to_scene.map(QPointF(pt.pos().x(), pt.pos().y())))
        h = pt.size() / 2
        rects.append(QRectF(at.x() - h, at.y() - h, 2 * h, 2 * h))
    return rects


def _assert_labels_clear(tree: PrefixTreeView) -> list[QRectF]:
    """No two shown labels intersect, none covers a node, none sticks out of the view."""
    labels = _label_rects(tree)
    vb = tree.plot.getViewBox()
    view = tree.plot.viewportTransform().mapRect(vb.sceneBoundingRect())
    for i, a in enumerate(labels):
        assert view.contains(a), (a, view)
        for b in labels[i + 1 :]:
            assert not a.intersects(b), (a, b)
    nodes = _node_rects(tree)
    for a in labels:
        for b in nodes:
            assert not a.intersects(b), (a, b)
    return labels


# -- text ---------------------------------------------------------------------------------


def test_readable_text_leaves_out_the_chat_template(chatml):
    ids = _prompt(chatml, SYSTEM, "Where is Lisbon?")
    special = special_token_ids(chatml)
    assert special == {1, 2}
    text = readable_text(chatml.decode, ids, special)
    assert text.text == SYSTEM + "\nWhere is Lisbon?"
    assert text.roles == ("system", "user", "assistant") and text.closes_turn
    # A page that starts right after a marker drops the role header it starts with.
    cut = ids.index(1, 1) + 1  # just after the second <|im_start|>
    assert readable_text(chatml.decode, ids[cut:], special, after_marker=True).text == (
        "Where is Lisbon?"
    )
    # Llama 3 puts the role between two markers; a message's own first line stays.
    llama = {7: "<|start_header_id|>", 8: "<|end_header_id|>", 9: "user", 10: "\n\nHi", 11: "!"}
    got = readable_text(lambda i: "".join(llama[t] for t in i), [7, 9, 8, 10, 11], {7, 8})
    assert got.text == "Hi!" and got.roles == ("user",)
    llama[10] = "\n\nhello\nthere"
    assert readable_text(lambda i: "".join(llama[t] for t in i), [7, 9, 8, 10], {7, 8}).text == (
        "hello\nthere"
    )
    # A tokenizer that names no special tokens but decodes them as text: the markers go
    # all the same.
    fallback = readable_text(chatml.decode, ids, frozenset())
    assert fallback.text == text.text and fallback.roles == text.roles


def test_special_tokens_come_from_the_real_tokenizer(smollm2_path):
    """SmolLM2's own special-token list (no list of templates in the view)."""
    from engine.model.tokenizer.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(smollm2_path)
    special = special_token_ids(tok)
    assert {tok.token_to_id("<|im_start|>"), tok.token_to_id("<|im_end|>")} <= special
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi there"}]
    ids = tok.encode_chat(messages)
    text = readable_text(tok.decode, ids, special)
    assert text.text == SYSTEM + "\nHi there"
    assert text.roles == ("system", "user", "assistant")


# -- the short shared prompt -------------------------------------------------------------


def test_a_shared_prompt_shorter_than_a_page_is_explained(qtbot, chatml):
    a = _prompt(chatml, SYSTEM, "Plan a day in Lisbon with trams and custard tarts.")
    b = _prompt(chatml, SYSTEM, "Explain a paged KV cache as you would to a child.")
    common = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    assert common == 21 < 32  # the system turn and the user header: 21 tokens
    snap = chat_cache([("lisbon", a, True), ("kv", b, True)], page_size=32)
    model = PrefixTreeModel()
    model.set_snapshot(snap, chatml)
    short = model.short_shared_prefix()
    assert (short.prompts, short.tokens, short.page_size, short.roles[:1]) == (
        2,
        21,
        32,
        ("system",),
    )
    assert short.explain() == (
        "the shared system prompt (21 tokens) is shorter than one 32-token page, so it is "
        "not shared; 16-token pages would share 16 of its tokens."
    )
    tree = _tree(qtbot, snap, chatml)
    caption = tree.caption.text()
    assert "0 shared" in caption and short.explain() in caption
    # Narrower, the caption drops the page counts to keep the explanation whole in its
    # two lines, and at the last keeps only the why.
    brief = "0 shared: " + short.explain(brief=True)
    metrics = QFontMetrics(tree.caption.font())
    seen = []
    for width in (700, 600, 500, 420, 340, 260):
        tree.resize(width, 300)
        QApplication.processEvents()
        text = tree.caption.text()
        box = metrics.boundingRect(QRect(0, 0, tree.caption.width(), 10_000), WRAP, text)
        assert brief in text and (text == brief or box.height() <= tree.caption.height())
        seen.append(text)
    assert seen[0] == caption and seen[-1] == brief
    assert "0 shared: " + short.explain() in seen
    assert all(len(a) >= len(b) for a, b in zip(seen, seen[1:], strict=False))

    # With 16-token pages the first page is common: shared, and nothing to explain.
    snap16 = chat_cache([("lisbon", a, True), ("kv", b, True)], page_size=16)
    model16 = PrefixTreeModel()
    model16.set_snapshot(snap16, chatml)
    assert model16.short_shared_prefix() is None
    assert any(n.shared for n in model16.nodes().values())
    # Prompts that share only the template's opening say nothing.
    c = _prompt(chatml, "Talk like a pirate, always.", "Plan a day in Lisbon.")
    other = PrefixTreeModel()
    other.set_snapshot(chat_cache([("a", a, True), ("c", c, True)]), chatml)
    assert other.short_shared_prefix() is None


# -- folding ------------------------------------------------------------------------------


def test_chains_fold_into_stacks_and_unfold_on_click(qtbot, chatml):
    snap = chat_cache(many_chats(chatml, 2, 12), page_size=32)
    tree = _tree(qtbot, snap, chatml)
    model = tree.model
    runs = model.runs()
    # The shared opening, then each chat's own pages: three stacks, not 20 nodes.
    assert len(runs) == 3 and all(r.folded for r in runs.values())
    assert sum(len(r.members) for r in runs.values()) == len(model.nodes())
    shared_run = next(r for r in runs.values() if model.get(r.key).shared and r.folded)
    assert all(model.get(k).shared for k in shared_run.members)
    assert (
        tree._labels[shared_run.key]
        .full_text()
        .startswith(f"{len(shared_run.members)} pages · You are Folio")
    )
    # A chain's pages are one kind: the shared ones never fold with a chat's own.
    for run in runs.values():
        assert len({model.get(k).kind for k in run.members}) == 1
        for up, down in zip(run.members, run.members[1:], strict=False):
            assert model.children_of(up) == [down]
    drawn = len(tree.scatter.points())
    assert drawn == len(runs)

    with qtbot.waitSignal(tree.node_clicked) as clicked:
        tree.click_node(shared_run.key)
    assert clicked.args[0] == model.chain_pages(shared_run.key)
    assert len(tree.scatter.points()) == drawn + len(shared_run.members) - 1
    assert model.run_of(shared_run.members[2]).members == [shared_run.members[2]]
    assert "Double-click to fold its chain again." in tree.tooltip(shared_run.members[2])
    assert tree.fold_node(shared_run.members[2])
    assert len(tree.scatter.points()) == drawn
    assert not tree.fold_node(shared_run.members[2])  # folded already

    # With the mouse: a click on the stack opens it, a second click soon after (the
    # second half of a double click) folds it again; a later one does not.
    vb = tree.plot.getViewBox()
    at = (vb.childTransform() * vb.sceneTransform()).map(QPointF(*shared_run.pos))
    at = tree.plot.mapFromScene(at)
    qtbot.mouseClick(tree.plot.viewport(), Qt.MouseButton.LeftButton, pos=at)
    assert len(tree.scatter.points()) == drawn + len(shared_run.members) - 1
    tree._last_click = (shared_run.key, -3600.0)  # as if the first click were long ago
    qtbot.mouseClick(tree.plot.viewport(), Qt.MouseButton.LeftButton, pos=at)
    assert len(tree.scatter.points()) == drawn + len(shared_run.members) - 1
    qtbot.mouseClick(tree.plot.viewport(), Qt.MouseButton.LeftButton, pos=at)
    assert len(tree.scatter.points()) == drawn


# -- tooltips -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "words"),
    [
        ((PageState.REFERENCED, 2, False, 32, 32, 0), "in use by 2 chats"),
        ((PageState.REFERENCED, 1, False, 17, 32, 0), "in use by 1 chat, being written (17 of 32 tokens)"),
        ((PageState.CACHED, 0, True, 32, 32, 0), "cached, reclaimable: evicted next when a new page is needed"),
        ((PageState.CACHED, 0, False, 32, 32, 3), "cached, reclaimable; kept because it is the head of a chain: the 3 pages after it are reused first"),
        ((PageState.CACHED, 0, False, 32, 32, 0), "cached, reclaimable: a prompt that begins the same way reuses it"),
        ((PageState.HOST, 0, False, 0, 32, 0), "in host memory only: copied back to the GPU when a prompt needs it"),
        ((PageState.DISK, 0, False, 0, 32, 0), "on disk only: read back when a prompt needs it"),
    ],
)  # fmt: skip
def test_states_in_words(args, words):
    assert state_in_words(*args) == words


def test_tooltips_speak_plainly(qtbot, chatml):
    a = _prompt(chatml, SYSTEM + " " + _words(0, 60), "Plan a day in Lisbon.")
    b = _prompt(chatml, SYSTEM + " " + _words(0, 60), "What is a KV cache?")
    old = _prompt(chatml, "Talk like a pirate. " + _words(9, 120), "Sing.")
    disk = [(111, 0), (222, 111)]
    snap = chat_cache(
        [("trip", a, True), ("kv", b, True), ("pirate", old, False)], page_size=32, disk=disk
    )
    tree = _tree(qtbot, snap, chatml)
    tree.chats.set_name("trip", "Trip to Lisbon")
    model = tree.model
    tips = {key: tree.tooltip(key) for key in model.runs()}
    flat = {key: " ".join(tip.split()) for key, tip in tips.items()}  # unwrapped
    for tip in tips.values():
        assert "<|" not in tip and "ref count" not in tip and "hash" not in tip
        assert not re.search(r"\b[0-9a-f]{12}\b", tip)  # no hash digests
        assert not re.search(r"\bsystem\b|\buser\b", tip)  # no role headers
    shared = next(k for k in tips if model.get(k).shared)
    assert tips[shared].startswith("Used by “Trip to Lisbon” and “kv”\n")
    assert "In use by 2 chats" in tips[shared]
    assert f"“{SYSTEM} w0x0 w0x1" in flat[shared]
    assert "tokens 1 to 32 of the prompt" in tips[shared]
    cached = [k for k in tips if model.get(k).state == PageState.CACHED]
    head = next(k for k in cached if model.get(k).parent is None)
    assert "kept because it is the head of a chain: the page after it" in flat[head]
    assert "Cached, reclaimable" in tips[head]
    leaf = next(k for k in cached if not model.children_of(model.run_of(k).members[-1]))
    assert "evicted next" in tips[leaf]
    on_disk = [k for k in tips if model.get(k).state == PageState.DISK]
    assert on_disk and all("On disk only" in tips[k] for k in on_disk)
    assert all(tips[k].startswith("1 page, 32 tokens\n") for k in on_disk)
    folded = next(k for k in tips if model.run_of(k).folded)
    members = [model.get(k) for k in model.run_of(folded).members]
    tokens = sum(m.fill for m in members)
    assert f"\n{len(members)} pages, {tokens} tokens" in "\n" + tips[folded]
    assert "Click to show its pages one by one." in tips[folded]
    # Jobs without a chat are named by their job id.
    assert tree._names((("job", 7), "kv")) == "“job 7” and “kv”"
    # The mouse on a node's label shows the node's words: the scene reports the move at
    # the label's middle, from where it is drawn on the screen (the platform's own mouse
    # routing is left out: in a full run another test's window may hold the mouse).
    label = tree._labels[shared]
    text = label.text_item
    at = text.deviceTransform(tree.plot.viewportTransform()).map(text.boundingRect().center())
    tree.plot.scene().sigMouseMoved.emit(tree.plot.mapToScene(at.toPoint()))
    assert tree.plot.getViewBox().toolTip() == tips[shared]
    tree._on_mouse_moved(QPointF(-50, -50))  # off every label: the tooltip goes
    assert tree.plot.getViewBox().toolTip() == ""


# -- geometry -----------------------------------------------------------------------------


def test_labels_make_room_as_you_zoom(qtbot, fake_tokenizer):
    """Labels are placed most telling first (roots, forks, leaves) and only where they
    overlap nothing; zooming in along the chains gives each more room."""
    tree = _tree(qtbot, synthetic_snapshot(256, chats=4), fake_tokenizer, size=(600, 300))
    before = _assert_labels_clear(tree)
    assert before, "the roots at least are labelled"
    roots = [k for k, r in tree.model.runs().items() if r.parent is None and k in tree._labels]
    assert any(tree._labels[k].isVisible() for k in roots)
    tree.plot.getViewBox().scaleBy((0.3, 1.0))
    after = _assert_labels_clear(tree)
    assert sum(r.width() for r in after) / len(after) > sum(r.width() for r in before) / len(before)


@pytest.mark.parametrize("chats", [3, 50])
def test_labels_never_overlap_and_stay_in_view(qtbot, chatml, chats):
    snap = chat_cache(many_chats(chatml, chats, 8), page_size=32)
    tree = _tree(qtbot, snap, chatml)
    labels = _assert_labels_clear(tree)
    assert len(labels) >= min(chats, 6), "the roots and forks in view at least"
    texts = [i.toPlainText() for i in tree._labels.values() if i.isVisible()]
    assert all("<|" not in t and not t.startswith("system") for t in texts)
    assert any(t.startswith("You are Folio") or "pages · You are" in t for t in texts)
    vb = tree.plot.getViewBox()
    for scale in ((0.4, 1.0), (1.0, 0.5), (4.0, 4.0), (0.5, 0.5)):  # zoom in, out, and back
        vb.scaleBy(scale)
        _assert_labels_clear(tree)
    tree.resize(420, 300)
    QApplication.processEvents()
    _assert_labels_clear(tree)
    # Every chain unfolded: many more nodes, still no overlap.
    for key in list(tree.model.runs()):
        tree.model.unfold(key)
    tree._redraw()
    _assert_labels_clear(tree)


def _grow(snap: EngineSnapshot, tokens: int, complete: int) -> EngineSnapshot:
    """The next snapshot of a decode step: every running chat's last page gains
    ``tokens`` tokens, and ``complete`` of them fill up (getting a content hash) with
    the chat going on in a fresh page: what the engine shows a few steps later."""
    c, size = snap.cache, snap.page_size
    fill, prefix, state = c.fill.copy(), c.hash_prefix.copy(), c.state.copy()
    ref, owners, edges = c.ref_count.copy(), list(c.owners), [c.edges]
    page_tokens = list(snap.page_tokens)
    has_child = np.zeros(snap.num_pages, bool)
    has_child[c.edges[:, 1]] = True
    leaves = np.flatnonzero((ref > 0) & ~has_child & (fill < size)).tolist()
    free = np.flatnonzero(fill == 0).tolist()
    for i, page in enumerate(leaves):
        page_tokens[page] = page_tokens[page] + [5] * tokens
        fill[page] += tokens
        if i < complete:
            page_tokens[page] = page_tokens[page][:size]
            fill[page], prefix[page] = size, np.uint64(10**12 + page)
            new = free.pop()
            fill[new], state[new], ref[new], owners[new] = 1, state[page], ref[page], owners[page]
            page_tokens[new] = [5]
            edges.append(np.array([[new, page]], np.int32))
    cache = dataclasses.replace(
        c, fill=fill, hash_prefix=prefix, state=state, ref_count=ref, owners=owners,
        edges=np.concatenate(edges),
    )  # fmt: skip
    return dataclasses.replace(snap, version=snap.version + 1, cache=cache, page_tokens=page_tokens)


def test_rebuild_and_layout_at_50_chats_of_100_pages(qtbot, chatml, record_property):
    """The cost of a snapshot for the tree at 50 chats x 100 pages: a model built from
    nothing (and laid out), and the view's update for a decode step in which every
    chat's last page grows and 10 of them fill up (re-keyed pages: a new layout).
    Recorded, not asserted."""
    snap = chat_cache(many_chats(chatml, 50, 100), page_size=32, spare=16)
    assert snap.num_pages > 2500
    t0 = time.perf_counter()
    model = PrefixTreeModel()
    model.set_snapshot(snap, chatml)
    model.relink()
    build = time.perf_counter() - t0
    tree = _tree(qtbot, snap, chatml)
    step = _grow(snap, 2, complete=10)
    t0 = time.perf_counter()
    tree.set_snapshot(step, chatml)
    tree.plot.viewport().repaint()
    update = time.perf_counter() - t0
    assert tree.model.last_update["relayout"] == 1 and tree.model.last_update["added"] == 20
    nodes, runs = len(tree.model.nodes()), len(tree.model.runs())
    print(
        f"\nprefix tree, 50 chats x 100 pages ({nodes} nodes, {runs} drawn): model built "
        f"and laid out from nothing {1e3 * build:.1f} ms; a decode step's update "
        f"(diff, relayout, labels, paint) {1e3 * update:.1f} ms"
    )
    record_property("prefix_tree_50x100_build_ms", round(1e3 * build, 2))
    record_property("prefix_tree_50x100_update_ms", round(1e3 * update, 2))
    assert runs < nodes / 20  # folded: a few stacks per chat
    _assert_labels_clear(tree)


def test_placeholder_and_reclaimed_pages_keep_folding_right(chatml):
    """When a chat ends its pages change kind (in use -> cached): its stack is redone,
    and the opening, now held by the other chat alone, folds with that chat's own."""
    chats = many_chats(chatml, 2, 6)
    model = PrefixTreeModel()
    model.set_snapshot(chat_cache(chats), chatml)
    before = {tuple(r.members) for r in model.runs().values()}
    done = [chats[0], (chats[1][0], chats[1][1], False)]
    model.set_snapshot(dataclasses.replace(chat_cache(done), version=2), chatml)
    after = {tuple(r.members) for r in model.runs().values()}
    assert model.last_update["relayout"] == 1
    ended = [r for r in model.runs().values() if model.get(r.key).state == PageState.CACHED]
    assert ended and all(not model.get(k).owners for r in ended for k in r.members)
    assert all(model.get(k).used_by == ("chat 2",) for r in ended for k in r.members)
    assert before != after
