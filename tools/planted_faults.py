"""Does `make test-fast` fail on a bug in a core rule? Plants each fault below alone (one exact source edit), runs the
fast tier, records which tests failed, and restores the file (`git checkout`). A file with uncommitted changes is
refused before anything is edited. Prints one line per fault; exit 1 when the tier passed with a fault planted.

    python -m tools.planted_faults                 # every fault (~3 minutes each on 2 cores)
    python -m tools.planted_faults --only verdict_on_hi
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# name: (file, the exact text, what it becomes): the rules docs/results/test_time.md lists
FAULTS = {
    "window_off_by_one": (
        "hybrid_scale/attention/hedgehog/naive.py",
        "in_past = causal & (pk <= pq - window)",
        "in_past = causal & (pk < pq - window)",
    ),
    "hedgehog_sign": (
        "hybrid_scale/attention/hedgehog/feature_maps.py",
        "torch.softmax(-u, dim=-1)], dim=-1)",
        "torch.softmax(u, dim=-1)], dim=-1)",
    ),
    "marker_hash_unchecked": (
        "hybrid_scale/storage/commits.py",
        "return all((directory / name).is_file() and sha256(directory / name) == h for name, h in files.items())",
        "return True",
    ),
    "layer_marker_trusted": (
        "hybrid_scale/distill/identity.py",
        'return json.loads(marker.read_text())["sha256"] == sha256(params)',
        "return True",
    ),
    "stage2_resumes_uncommitted": (
        "hybrid_scale/finetune/checkpoints.py",
        "return [p for p in steps if is_committed(p)]",
        "return steps",
    ),
    "requeue_no_marker": (
        "hybrid_scale/distributed/requeue.py",
        '        atomic_write(Path(run_dir) / REQUEUE_MARKER, f"{step}\\n")',
        "        pass",
    ),
    "requeue_exit_code": ("hybrid_scale/distributed/requeue.py", "EXIT_REQUEUE = 75", "EXIT_REQUEUE = 1"),
    "ssd_schedule_boundary": ("hybrid_scale/recipes/ssd.py", "if progress >= fraction:", "if progress > fraction:"),
    "ssd_drop_direction": ("hybrid_scale/recipes/ssd.py", "out = {i: bool(d < p)", "out = {i: bool(d > p)"),
    "verdict_on_hi": ("hybrid_scale/evaluate/balance.py", "    if lo > margin:", "    if hi > margin:"),
    # the LA's decay (attention.la_decay, tests/unit/test_la_decay.py)
    "decay_ignored_chunked": (
        "hybrid_scale/attention/hedgehog/chunk.py",
        'rho = la_decay.to(q.dtype) if la_decay is not None and mode in ("hybrid", "la_only") else None',
        "rho = None",
    ),
    "decay_gradient_dropped": (
        "hybrid_scale/attention/hedgehog/chunk.py",
        'rho = la_decay.to(q.dtype) if la_decay is not None and mode in ("hybrid", "la_only") else None',
        'rho = la_decay.detach().to(q.dtype) if la_decay is not None and mode in ("hybrid", "la_only") else None',
    ),
    "decay_on_the_sinks": (
        "hybrid_scale/attention/hedgehog/naive.py",
        "            e = gamma * e\n",
        "            e = gamma * e\n        if la_decay is not None and hybrid_sinks:\n"
        "            e = torch.where(sink & ~in_window, e * decay_weight(rho, pq - window - pk), e)\n",
    ),
    "decay_state_not_carried": (
        "hybrid_scale/attention/hedgehog/recurrent.py",
        "        kv, ksum = kv * carry[..., None], ksum * carry\n        fold_ring = fold_ring",
        "        fold_ring = fold_ring",
    ),
    "decay_not_in_stage1_state": (
        "hybrid_scale/distill/objectives.py",
        "        if rho is not None:  # as row a = a0 + w - 1 sees key j: alpha^(a - w - j)",
        "        if False:",
    ),
    # the chunked Triton kernels (tests/unit/test_triton_kernels.py, test_chunk_*.py: the interpreter on CPU)
    "kernel_decay_ignored": (
        "kernels/hybrid_scale_kernels/chunk_o.py",
        "                    s = s * tl.exp(-rho * tl.maximum(n[:, None] - window - j[None, :], 0).to(tl.float32))\n",
        "                    s = s * 1.0\n",
    ),
    "kernel_decay_gradient_dropped": (
        "kernels/hybrid_scale_kernels/chunk.py",
        "                drho = total.to(rho.dtype)",
        "                drho = torch.zeros_like(rho)",
    ),
    "kernel_decay_on_the_sinks": (
        "kernels/hybrid_scale_kernels/chunk_o.py",
        "        p_s = g * tl.exp(a_s - m[:, None])",
        "        p_s = g * tl.exp(a_s - m[:, None] - rho * tl.maximum(n[:, None] - window - js[None, :], 0))",
    ),
    "kernel_la_only_window_decayed": (
        "kernels/hybrid_scale_kernels/utils.py",
        "return max(1, -(-int(window) // CHUNK)) if (soft or decay) else 1",
        "return max(1, -(-int(window) // CHUNK)) if soft else 1",
    ),
    "kernel_state_gradient_not_carried": (
        "kernels/hybrid_scale_kernels/chunk_h.py",
        "            dh = dh * carry\n",
        "",
    ),
    "kernel_split_state_gradient_not_fixed": (
        "kernels/hybrid_scale_kernels/chunk_h.py",
        "fixed = tl.load(ptr, mask=both, other=0.0).to(tl.float32) + wt * dn",
        "fixed = tl.load(ptr, mask=both, other=0.0).to(tl.float32)",
    ),
    "kernel_split_rho_share_dropped": (
        "kernels/hybrid_scale_kernels/chunk_h.py",
        "tl.load(RSCAN + pid) - CHUNK * share)",
        "tl.load(RSCAN + pid))",
    ),
    "kernel_split_rho_share_unweighted": (  # the carries' decay on that share, h_s read in the fix
        "kernels/hybrid_scale_kernels/chunk_h.py",
        "share += wt * tl.sum(tl.sum(dn * h, 1) + dzn * z, 0)",
        "share += tl.sum(tl.sum(dn * h, 1) + dzn * z, 0)",
    ),
    "kernel_dkv_l_block_skipped_at_its_edge": (  # a query block whose last row is exactly lin_off past the first key
        "kernels/hybrid_scale_kernels/chunk_bwd.py",
        "if q0 + BLOCK_Q - 1 - c * CHUNK >= lin_off:",
        "if q0 + BLOCK_Q - 1 - c * CHUNK > lin_off:",
    ),
    "kernel_dq_own_l_block_skipped": (
        "kernels/hybrid_scale_kernels/chunk_bwd.py",
        "OWN_L=case.lin_off < case.chunk,",
        "OWN_L=case.lin_off < case.chunk - 1,",
    ),
    "kernel_output_l_block_skipped_at_its_edge": (
        "kernels/hybrid_scale_kernels/chunk_o.py",
        "if c * CHUNK + CHUNK - 1 - kb >= lin_off:",
        "if c * CHUNK + CHUNK - 1 - kb > lin_off:",
    ),
    "kernel_rho_lag_share_dropped": (  # rho's gradient through the queries' lags on their state
        "kernels/hybrid_scale_kernels/chunk_h.py",
        "eh += tl.dot(fqt.to(DT), (dy.to(tl.float32) * (el / zs)[:, None]).to(DT), input_precision=PREC)",
        "pass",
    ),
    "kernel_initial_state_dropped": (
        "kernels/hybrid_scale_kernels/chunk_h.py",
        "            h += tl.load(H0 + (base * F + of)[:, None] * D + od[None, :], mask=both, other=0.0)\n",
        "",
    ),
    "kernel_initial_state_gradient_dropped": (
        "kernels/hybrid_scale_kernels/chunk.py",
        "        dinit_kv, dinit_k = dinit",
        "        dinit_kv, dinit_k = (None if t is None else torch.zeros_like(t) for t in dinit)",
    ),
    "kernel_padding_not_packed": (
        "kernels/hybrid_scale_kernels/chunk.py",
        "    if bool(real.all()):",
        "    if True:",
    ),
    "kernel_one_chunk_back_at_any_window": (
        "kernels/hybrid_scale_kernels/utils.py",
        "return max(1, -(-int(window) // CHUNK)) if (soft or decay) else 1",
        "return 1",
    ),
    "kernel_denominators_swapped": (
        "kernels/hybrid_scale_kernels/chunk_o.py",
        "        tl.store(DE + q_base + n, den - den_l, mask=row_ok)",
        "        tl.store(DE + q_base + n, den_l, mask=row_ok)",
    ),
    "kernel_decode_state_not_carried": (
        "kernels/hybrid_scale_kernels/decode.py",
        "carry = tl.exp(-rho)",
        "carry = 1.0",
    ),
    # the key-side backward (_chunk_bwd_dkv) and dq's state term (tests/unit/test_chunk_backward.py)
    "kernel_key_side_skips_a_query_block": (
        "kernels/hybrid_scale_kernels/chunk_bwd.py",
        "for q0 in range(c * CHUNK, tl.minimum((c + NB + 1) * CHUNK, T), BLOCK_Q):",
        "for q0 in range(c * CHUNK, tl.minimum((c + NB) * CHUNK, T), BLOCK_Q):",
    ),
    "kernel_sinks_dv_dropped": (
        "kernels/hybrid_scale_kernels/chunk_bwd.py",
        "                svt += tl.dot((dyt.to(tl.float32) / zs[None, :]).to(DT), e_s, input_precision=PREC)\n",
        "",
    ),
    "kernel_sink_sums_never_written": (
        "kernels/hybrid_scale_kernels/chunk_bwd.py",
        'if tl.atomic_add(COUNT + pid_bk, 1, sem="acq_rel") == NC - 1:',
        'if tl.atomic_add(COUNT + pid_bk, 1, sem="acq_rel") == NC:',
    ),
    "kernel_dphi_k_state_dz_dropped": (
        "kernels/hybrid_scale_kernels/chunk_bwd.py",
        "            acc_f = (acc_f + dz[:, None]) * wk[None, :]",
        "            acc_f = acc_f * wk[None, :]",
    ),
    "kernel_dq_state_product_dropped": (
        "kernels/hybrid_scale_kernels/chunk_bwd.py",
        "                    sp = tl.dot(do, ht, input_precision=PREC)",
        "                    sp = 0.0 * tl.dot(do, ht, input_precision=PREC)",
    ),
    # the query heads of a KV head folded into one program (tests/unit/test_head_fold.py and every kernel test)
    "kernel_fold_output_repeats_a_head": (
        "kernels/hybrid_scale_kernels/chunk_o.py",
        "DE, DL, tl.program_id(0) * GF + hh,",
        "DE, DL, tl.program_id(0) * GF,",
    ),
    "kernel_fold_dq_repeats_a_head": (
        "kernels/hybrid_scale_kernels/chunk_bwd.py",
        "tl.program_id(0) * GF + hh, tl.program_id(1)",
        "tl.program_id(0) * GF, tl.program_id(1)",
    ),
    "decay_ignored_by_the_layer": (
        "hybrid_scale/attention/layer.py",
        "            la_decay=self.la_decay if la_decay is None else la_decay,",
        "            la_decay=None,",
    ),
}
TIER = [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "worksteal", "-m", "fast", "-p", "no:cacheprovider"]


def plant(name: str) -> bool:
    """True when the tier failed with the fault in place."""
    path, old, new = FAULTS[name]
    source = ROOT / path
    text = source.read_text()
    if text.count(old) != 1:
        raise SystemExit(f"{name}: {path} no longer holds its text exactly once; update FAULTS")
    source.write_text(text.replace(old, new))
    try:
        start = time.time()
        r = subprocess.run([*TIER, "-x"], cwd=ROOT, capture_output=True, text=True)
        failed = sorted(set(re.findall(r"^FAILED (\S+)", r.stdout, re.M)))
        print(f"{name}: {'caught' if failed else 'MISSED'} in {time.time() - start:.0f} s: {', '.join(failed)}")
        return bool(failed)
    finally:
        subprocess.run(["git", "checkout", "--", path], cwd=ROOT, check=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", nargs="+", choices=sorted(FAULTS), help="these faults only")
    args = p.parse_args()
    names = args.only or list(FAULTS)
    dirty = [n for n in names if subprocess.run(["git", "diff", "--quiet", "--", FAULTS[n][0]], cwd=ROOT).returncode]
    if dirty:
        raise SystemExit(f"uncommitted changes in {', '.join(sorted({FAULTS[n][0] for n in dirty}))}: commit or stash")
    return 0 if all([plant(n) for n in names]) else 1


if __name__ == "__main__":
    sys.exit(main())
