"""The multi-host path through real network interfaces: two ranks in two network namespaces joined by a
shaped veth pair (``benchmarks/links.py``), with torchrun's variables over gloo, exact against one device.

Needs root (namespaces and tc); elsewhere the test is skipped and says why.
"""

import subprocess
import sys

import numpy as np
import pytest

from benchmarks.links import Link, rate_bytes, unavailable
from tests.conftest import SCRIPTS
from tests.test_exactness import load, max_relative_error

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]


def test_rate_parsing_says_what_it_accepts():
    assert rate_bytes("1gbit") == 125e6
    assert rate_bytes("100mbit") == 12.5e6
    with pytest.raises(ValueError, match="Received: '1 gigabit'"):
        rate_bytes("1 gigabit")


@pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))
def test_two_hosts_over_a_shaped_link_match_one_device(runner):
    rows = ["--rows", "100", "--optimizers", "sgd", "--epochs", "2"]
    ref = runner.tmp_path / "plain.npz"
    reference = runner.start([sys.executable, str(SCRIPTS / "exactness.py"), str(ref), "--plain", *rows])  # meanwhile
    out = runner.tmp_path / "par.npz"
    args = [sys.executable, str(SCRIPTS / "exactness.py"), str(out), "--devices", "cpu:0,cpu:1", "--ratios", "3,1",
            *rows]
    with Link("1gbit", tag=runner.token[:5]) as link:
        # A fixed port is free: it is in the link's own network namespaces, made for this test.
        procs = [runner.start(link.command(r, args), extra_env=link.rank_env(r, 29511)) for r in range(2)]
        done = [runner.finish(p, timeout=120) for p in procs]
        # both hosts exist while the ranks run
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
        assert link.hosts[0] in names and link.hosts[1] in names
    assert all(d.returncode == 0 for d in done), done[0].stdout[-3000:] + done[1].stdout[-3000:]
    res = runner.finish(reference, timeout=120)
    assert res.returncode == 0, res.stdout
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert link.hosts[0] not in names and link.hosts[1] not in names  # cleaned up
    (ref_w, ref_h), (w, h) = load(ref, ("sgd",))["sgd"], load(out, ("sgd",))["sgd"]
    assert max_relative_error(ref_w, w) <= 1e-5
    np.testing.assert_allclose(h["loss"], ref_h["loss"], rtol=1e-5)
    assert bool(np.load(out)["sgd.overlap"])  # gradient sums started during the backward pass
    other = load(f"{out}.rank1.npz", ("sgd",))["sgd"]
    assert max_relative_error(w, other[0]) == 0.0
    assert runner.leftovers() == []
