"""Random jobs against the page table, with content checks after every step.

Jobs draw prompts from a few shared prefixes (so they hit, dedup and share) plus
random tails; they prefill, generate deterministic continuations (so identical
generations dedup), fork (copy-on-write), release, get evicted to the host tier,
restore and defragment. After every step ``validate()`` holds and every complete
page, on the device or in the tier, holds exactly the rows written for its prefix.
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.cache import CacheFullError, PagesUnavailableError
from tests.engine.cache import (
    assert_prefix_content,
    expected_rows,
    fill,
    make_table,
    read_rows,
)

PAGE = 16
PREFIXES = [
    [7] * 40,
    list(range(100, 150)),
    list(range(100, 120)) + list(range(300, 330)),
]


class PageTableMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.table = make_table(num_pages=14, page_size=PAGE, tier_slots=6)
        self.jobs: dict[int, dict] = {}
        self.next_id = 0
        # content hash -> expected K/V of that full page (device or tier)
        self.expected: dict[bytes, torch.Tensor] = {}

    def _record_complete_pages(self, job: dict) -> None:
        alloc, seq = job["alloc"], job["seq"]
        for logical, page in enumerate(alloc.block_table):
            rec = self.table.pages[page]
            if rec.has_content_hash and rec.fill == PAGE and (logical + 1) * PAGE <= len(seq):
                want = expected_rows(seq, logical, PAGE, PAGE)
                if rec.hash in self.expected:
                    assert torch.equal(self.expected[rec.hash], want), "one hash, two contents"
                self.expected[rec.hash] = want

    @rule(
        prefix=st.integers(0, len(PREFIXES) - 1),
        cut=st.integers(1, 50),
        tail=st.lists(st.integers(0, 5), max_size=20),
        max_rq=st.integers(0, 40),
        eviction_policy=st.sampled_from(["tail_first", "lru"]),
    )
    def start_job(self, prefix, cut, tail, max_rq, eviction_policy):
        self.table.policy = eviction_policy
        seq = PREFIXES[prefix][:cut] + tail
        job_id = self.next_id
        self.next_id += 1
        total = self.table.pages_total(len(seq), max_rq)
        if total > self.table.num_pages:
            try:
                self.table.allocate(job_id, seq, max_rq)
            except CacheFullError as e:
                assert str(total) in str(e) and str(self.table.num_pages) in str(e)
                return
            raise AssertionError("oversized job was allocated")
        if not self.table.can_allocate(seq, max_rq):
            try:
                self.table.allocate(job_id, seq, max_rq)
            except PagesUnavailableError:
                return
            raise AssertionError("allocate succeeded where can_allocate said no")
        alloc = self.table.allocate(job_id, seq, max_rq)
        assert len(alloc.block_table) == total
        assert alloc.cached_tokens <= len(seq) - 1
        assert_prefix_content(self.table, alloc, seq)
        self.jobs[job_id] = {"alloc": alloc, "seq": list(seq), "salt": 0}

    @precondition(lambda self: self.jobs)
    @rule(data=st.data())
    def prefill(self, data):
        job_id = data.draw(st.sampled_from(sorted(self.jobs)))
        job = self.jobs[job_id]
        try:
            fill(self.table, job["alloc"], job["seq"], job["alloc"].prompt_len - 1)
        except PagesUnavailableError:
            return  # copy-on-write found no free page
        self._record_complete_pages(job)

    @precondition(lambda self: self.jobs)
    @rule(data=st.data(), steps=st.integers(1, 20))
    def generate(self, data, steps):
        job_id = data.draw(st.sampled_from(sorted(self.jobs)))
        job = self.jobs[job_id]
        alloc, seq = job["alloc"], job["seq"]
        try:
            fill(self.table, alloc, seq, alloc.prompt_len - 1)
            capacity = len(alloc.block_table) * PAGE
            for _ in range(steps):
                if len(seq) >= capacity:
                    break
                # decode writes the last token, then samples the next one
                fill(self.table, alloc, seq, len(seq))
                seq.append((seq[-1] * 7 + 3 + job["salt"]) % 50)
        except PagesUnavailableError:
            return
        self._record_complete_pages(job)

    @precondition(lambda self: self.jobs)
    @rule(data=st.data())
    def fork(self, data):
        job_id = data.draw(st.sampled_from(sorted(self.jobs)))
        parent = self.jobs[job_id]
        child_id = self.next_id
        self.next_id += 1
        child = self.table.fork(parent["alloc"], child_id)
        salt = data.draw(st.integers(0, 3))
        self.jobs[child_id] = {"alloc": child, "seq": list(parent["seq"]), "salt": salt}

    @precondition(lambda self: self.jobs)
    @rule(data=st.data())
    def release(self, data):
        job_id = data.draw(st.sampled_from(sorted(self.jobs)))
        self._record_complete_pages(self.jobs[job_id])
        self.table.release(self.jobs.pop(job_id)["alloc"])

    @rule(salt=st.integers(0, 1000))
    def pressure(self, salt):
        """A throwaway job over every free page: cached pages go to the host tier."""
        free = len(self.table.unreferenced)
        if free == 0:
            return
        seq = [1000 + salt + i for i in range(free * PAGE)]
        job_id = self.next_id
        self.next_id += 1
        alloc = self.table.allocate(job_id, seq, 0)
        fill(self.table, alloc, seq, len(seq) - 1)
        self.table.release(alloc)

    @precondition(lambda self: not self.jobs)
    @rule()
    def defrag(self):
        before = {
            h: read_rows(self.table.storage, p.index, PAGE)
            for h, p in self.table.unreferenced.items()
            if p.has_content_hash
        }
        self.table.defrag()
        after = {
            h: read_rows(self.table.storage, p.index, PAGE)
            for h, p in self.table.unreferenced.items()
            if p.has_content_hash
        }
        assert before.keys() == after.keys()
        for h in before:
            assert torch.equal(before[h], after[h]), "defrag changed a page's content"

    @invariant()
    def consistent(self):
        self.table.validate()
        for alloc in self.table.allocations.values():
            assert len(set(alloc.block_table)) == len(alloc.block_table)

    @invariant()
    def full_pages_hold_their_content(self):
        table = self.table
        for page in table.pages:
            if page.has_content_hash and page.fill == PAGE and page.hash in self.expected:
                got = read_rows(table.storage, page.index, PAGE)
                assert torch.equal(got, self.expected[page.hash]), f"page {page.index} content"
        tier = table.host_tier
        for h, entry in tier.entries.items():
            if h in self.expected:
                got = read_rows(tier.storage, entry.index, PAGE)
                assert torch.equal(got, self.expected[h]), f"tier slot {entry.index} content"

    def teardown(self):
        for job in list(self.jobs.values()):
            self.table.release(job["alloc"])
        self.jobs.clear()
        self.table.validate()
        assert not self.table.referenced
        assert all(p.ref_count == 0 for p in self.table.pages)


PageTableMachine.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestPageTable = PageTableMachine.TestCase
