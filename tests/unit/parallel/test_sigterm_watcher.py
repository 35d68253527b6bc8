"""SIGTERM under torchrun: the worker says where the run stands even while its main thread is blocked
in C++ (a collective whose peer died), where Python's own handler cannot run until the call returns."""

from __future__ import annotations

import datetime
import os
import signal
import threading

import pytest
import torch.distributed as dist

from titanctl.parallel.runtime import elastic


def test_sigterm_is_announced_while_the_main_thread_is_blocked_in_a_store_wait():
    timeout = datetime.timedelta(seconds=20)
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timeout)
    client = dist.TCPStore("127.0.0.1", store.port, 1, False, timeout=timeout)
    said: list[str] = []

    def say():  # the only thing that ends the main thread's wait below
        said.append("where the run stands")
        client.set("announced", "1")

    announce = elastic.once(say)
    handler_before = signal.getsignal(signal.SIGTERM)
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM))
    with pytest.raises(elastic.Terminated):
        with elastic.sigterm_raises(announce):
            timer.start()
            store.wait(["announced"])  # C++ with the GIL released; Python's handler raises once it returns
    assert said == ["where the run stands"]
    announce()  # the except-Terminated path calls it again: nothing more is said
    assert said == ["where the run stands"]
    assert signal.getsignal(signal.SIGTERM) is handler_before
    assert signal.set_wakeup_fd(-1) == -1  # the watcher's pipe is no longer the wakeup fd


def test_without_an_announcement_no_watcher_is_started():
    threads = threading.active_count()
    with elastic.sigterm_raises():
        assert threading.active_count() == threads
