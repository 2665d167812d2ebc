"""Batch plans: one batch's transfers between a `HostPool` and a device pool, planned once.

flashinfer's ``plan()`` / ``run()`` split: the caller says when a batch starts
(`HostPool.plan`), and each call after that only launches. A plan copies the batch's
index lists into tensors of its own when it is made, so nothing the caller does to its
own tensors afterwards (by torch or by any other means) reaches it, and checks them
once: host-resident lists on the host at once (raising `KvtierError` naming the argument
and the value), device-resident ones by a check launch whose verdict belongs to the
plan (every launch of the plan reads them; a bad list makes them all move nothing, and
its failure is raised at the making thread's next call or `synchronize`). The plan's
launches then check nothing more: its lists are its own, and so is the verdict.

A plan is used on the stream it was made on; used on another one, that stream first
waits for the plan's copies and check. A plan holds its lists, its verdict and the pools
(whose buffers it moves); drop it when the batch is done.
"""
from __future__ import annotations

from typing import Optional

import torch

import kvtier.platforms as platforms
from kvtier.kernels import faults
from kvtier.kernels.index_check import Checks, check_launch, check_list_on_host, checks_on
from kvtier.kernels.launcher import direct_launches
from kvtier.kernels.storage_watch import check_storage


class TransferPlan:
    """One batch between ``host`` (a `HostPool`) and ``device_pool`` at the index lists
    given (shapes as the pool's calls take them): `load_layer`, `load` and `backup` move
    it as `HostPool.load_to_device_per_layer`, `load_to_device_all_layer` and
    `backup_from_device_all_layer` would. Its steps are the host pool's prepared
    transfers' (`HostPool.transfers_for`) for its lists' size, their storage watch
    checked once: the pools' buffers must stay where they are while the plan is used."""

    def __init__(self, host, device_pool, host_indices: torch.Tensor, device_indices: torch.Tensor):
        self.host, self.device_pool = host, device_pool
        self.transfers = transfers = host.transfers_for(device_pool)
        host._check_shapes(device_pool, host_indices, device_indices)
        device = host.device
        self.n = n = device_indices.numel()
        self.start_layer, self.num_layers = device_pool.start_layer, device_pool.num_layers
        # The lists, the plan's own: a snapshot on the host (the dma path plans its bulk
        # copies from it) and, where the copy runs on an accelerator, on the device.
        self.host_indices = host_indices.to("cpu", copy=True) if host_indices.is_cpu else host_indices.clone()
        self.device_indices = device_indices.clone()
        if host.device.type == "cpu" or not self.host_indices.is_cpu:
            self.host_on_device = self.host_indices
        else:
            self.host_on_device = self.host_indices.pin_memory().to(device, non_blocking=True)
        self.checked = False
        self.verdict: Optional[torch.Tensor] = None
        self._check(device)
        # Each call's steps, resolved now (none for an empty batch); the tensors they rest
        # on checked to be where their maps were built.
        self.backup_steps = self.load_steps = None
        self.layer_steps, self.layer_grids = [], []
        if n:
            for t in (transfers.backup, transfers.load, *transfers.layers):
                if t.watch is not None:
                    check_storage(t.watch)
            self.backup_steps, self.load_steps = transfers.backup.steps(n), transfers.load.steps(n)
            self.layer_steps = [t.steps(n) for t in transfers.layers]
            # each launch's programs for this batch's count, worked out once
            self.layer_grids = [tuple(b.grid(n) for b in st.launches) for st in self.layer_steps]
        self.stream = None if device.type == "cpu" else platforms.stream_key(device)
        self._ready = None
        if device.type != "cpu":
            self._ready = getattr(torch, device.type).Event()
            self._ready.record()

    def _check(self, device: torch.device) -> None:
        """The lists' values, once: host-resident ones here (raising at once), the
        device-resident ones by one check launch writing the plan's verdict."""
        host = self.host
        if not checks_on(host.check):
            return
        page = host._index_page
        lists = (("host_indices", host.size, page, self.host_indices),
                 ("device_indices", self.transfers.backup.checks.src_limit, page, self.device_indices))
        on_device = []
        for name, limit, page, idx in lists:
            if _checked_on_host(name, idx):
                check_list_on_host(name, idx, limit, page, False)
            else:
                on_device.append((name, limit, page, idx))
        if on_device:
            a, b = on_device[0], on_device[-1]
            self.verdict = torch.zeros(2, dtype=torch.int32, device=device)
            check_launch(device, Checks(a[:3], b[:3]), a[3], b[3], verdict=self.verdict, two=len(on_device) == 2,
                         direct=direct_launches())
        self.checked = True

    # ------------------------------------------------------------------ the batch's calls
    def load_layer(self, layer_id: int) -> None:
        """Host -> device, model layer ``layer_id`` only (the layer loop's call)."""
        faults.raise_pending()      # a failure of this plan's check (or another call's) first
        local = layer_id - self.start_layer if type(layer_id) is int else -1
        if not 0 <= local < self.num_layers:
            self.device_pool.local_layer(layer_id)         # (names what is wrong)
        if not self.n:
            return
        if self.stream is not None:
            self._same_stream()
        self.transfers.layers[local].launch_checked(self.layer_steps[local], self.host_on_device,
                                                    self.device_indices, self.host_indices, self.verdict, self.checked,
                                                    grids=self.layer_grids[local])

    def load(self) -> None:
        """Host -> device, every layer (target pool: drafts too)."""
        self._all_layers(self.transfers.load, self.load_steps, self.host_on_device, self.device_indices)

    def backup(self) -> None:
        """Device -> host, every layer (target pool: drafts too)."""
        self._all_layers(self.transfers.backup, self.backup_steps, self.device_indices, self.host_on_device)

    def _all_layers(self, transfer, steps, si: torch.Tensor, di: torch.Tensor) -> None:
        faults.raise_pending()
        if self.n:
            if self.stream is not None:
                self._same_stream()
            transfer.launch_checked(steps, si, di, self.host_indices, self.verdict, self.checked)

    def _same_stream(self) -> None:
        """On a stream other than the plan's, wait for the plan's copies and check first."""
        if platforms.stream_key(self.host.device) != self.stream:
            platforms.current_stream(self.host.device).wait_event(self._ready)


def _checked_on_host(name: str, idx: torch.Tensor) -> bool:
    """Whether the plan checks list ``name`` on the host (a host-resident one), else by its
    check launch. (One place, so that tests can send CPU lists through the check launch, as
    device-resident lists take it on an accelerator.)"""
    return idx.is_cpu


__all__ = ["TransferPlan"]
