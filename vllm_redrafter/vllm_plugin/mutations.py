"""Test-only mutation switches: each breaks one part of a tree verify step, on purpose.

``tests/test_vllm_plugin.py`` turns them on one at a time to show that its greedy identity and
exact-sampling tests notice each break (``docs/exactness.md``). All are off by default and are
never turned on outside tests; off, each costs one module attribute read per verify step. They
reach an engine only when it runs in the test's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``).
"""

from __future__ import annotations

SKIP_KV_MOVE = False  # verifier: the accepted nodes' KV stays where the tree put it
CAUSAL_TREE_MASK = False  # runner patch: tree rows keep vLLM's causal mask, not the ancestor mask
NO_POSITION_REWRITE = False  # runner patch: node j keeps RoPE position p + j, not p + depth[j]
BONUS_AT_DEPTH_ROW = False  # verifier: the bonus is drawn at packed row d (beam 0's node at the
#                             accepted depth d, as if the tree were a chain), not at the last
#                             accepted node

NAMES = ("SKIP_KV_MOVE", "CAUSAL_TREE_MASK", "NO_POSITION_REWRITE", "BONUS_AT_DEPTH_ROW")
