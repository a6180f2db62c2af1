"""The acceptance rule: which draft tokens the target keeps, and which token it emits after them.

`speculative_accept` is speculative sampling (Leviathan et al. 2023, Chen et al. 2023): every
emitted token is distributed exactly as if the target had decoded alone. `greedy_accept` is its
temperature-0 special case, working on logits so no distribution needs to be built.

Row i of the target's output is its distribution for the token after draft_tokens[:i], so a
round with k drafts yields k+1 rows; the last one gives the bonus token when all k are accepted.
"""
from __future__ import annotations

import numpy as np

from specdec.errors import SpecdecError
from specdec.runtime.sampling import sample

# How far a p_draft row's sum may stray from 1: float32 rows of any vocabulary land within ~1e-6 of it, while a
# drafter that forgot to normalise (or reports logits, or a softmax over another temperature) is far off.
P_DRAFT_SUM_TOLERANCE = 1e-4


def greedy_accept(draft_tokens: np.ndarray, target_logits: np.ndarray) -> tuple[int, int]:
    """Keep the longest draft prefix that matches the target's argmax; emit the argmax after it.

    Returns (n_accepted, next_token): next_token is the target's correction at the first
    mismatch, or its bonus token when all k drafts match.
    """
    target_logits = np.asarray(target_logits)  # [k+1, vocab]
    _check_rows(target_logits, np.asarray(draft_tokens).shape[0])
    return greedy_accept_choices(draft_tokens, np.argmax(target_logits, axis=-1))


def greedy_accept_choices(draft_tokens: np.ndarray, target_choice: np.ndarray) -> tuple[int, int]:
    """greedy_accept given the target's argmax per row [k+1] instead of its logits."""
    draft_tokens = np.asarray(draft_tokens)  # [k]
    k = draft_tokens.shape[0]
    target_choice = np.asarray(target_choice)  # [k+1]
    if target_choice.shape != (k + 1,):
        raise ValueError(f"need the target's choice for {k + 1} positions, got shape {target_choice.shape}")
    mismatch = draft_tokens != target_choice[:k]  # [k]
    n_accepted = int(np.argmax(mismatch)) if mismatch.any() else k
    return n_accepted, int(target_choice[n_accepted])


def speculative_accept(
    draft_tokens: np.ndarray,
    p_draft: np.ndarray | None,
    p_target: np.ndarray,
    rng: np.random.Generator,
) -> tuple[int, int]:
    """Speculative sampling: accept draft x at row i with probability min(1, p_target[i,x] / p_draft[i,x]).

    On the first rejection the next token is drawn from `residual(p_target[i], p_draft[i])` and the
    round ends; if all k drafts pass, the bonus token is drawn from p_target[k].

    p_draft None means a deterministic drafter: its draft is one-hot, so x is accepted with
    probability p_target[i,x] and the correction comes from p_target[i] with x removed.

    A draft with p_draft[i,x] == 0 cannot come from a drafter that samples p_draft, so its
    p_draft row says nothing about how x was chosen. Accepting it (ratio +inf) would emit
    whatever the drafter produced off its support; rejecting into the residual would overweight
    the tokens p_draft under-covers. Either biases the output. Instead the draft is discarded and
    the token is drawn from p_target[i] itself: whatever x was, that token is distributed as
    p_target[i], so the output stays exact (a drafter that samples p_draft except for rare
    off-support slips stays lossless; tests/test_acceptance.py checks that mixture).

    Returns (n_accepted, next_token) as Python ints.
    """
    draft_tokens = np.asarray(draft_tokens)  # [k]
    k = draft_tokens.shape[0]
    p_target = np.asarray(p_target)  # [k+1, vocab] not widened: only the values used below are
    _check_rows(p_target, k)
    if p_draft is not None:
        p_draft = check_p_draft(p_draft, k, p_target.shape[1])  # [k, vocab]

    rows = np.arange(k)
    p_target_x = p_target[rows, draft_tokens]  # [k] target's mass on each draft
    p_draft_x = np.ones(k) if p_draft is None else p_draft[rows, draft_tokens]  # [k]
    off_support = p_draft_x <= 0.0  # [k] see docstring: such a draft is discarded, not judged
    # u < p_t/p_d, multiplied out so p_t == 0 never accepts and p_t >= p_d always does (u is
    # float64, so float32 rows are compared in float64). All k uniforms are drawn up front, one
    # per draft whether or not it is reached, so the whole round is a few array operations.
    accepted = (rng.random(k) * p_draft_x < p_target_x) & ~off_support  # [k]
    n_accepted = k if accepted.all() else int(accepted.argmin())  # first rejection
    if n_accepted == k:
        return k, sample(p_target[k], rng)  # bonus token
    if off_support[n_accepted]:
        return n_accepted, sample(p_target[n_accepted], rng)
    if p_draft is None:
        p_draft_row = np.zeros(p_target.shape[1])  # [vocab] one-hot: the draft was certain
        p_draft_row[draft_tokens[n_accepted]] = 1.0
    else:
        p_draft_row = p_draft[n_accepted]  # [vocab]
    return n_accepted, sample(residual(p_target[n_accepted], p_draft_row), rng)


def tree_greedy_accept(draft_tokens: np.ndarray, parents: np.ndarray, target_logits: np.ndarray) -> tuple[list[int], int]:
    """Greedy acceptance over a token tree: from the root, step to the child holding the target's argmax while
    there is one; emit the argmax after the last accepted node.

    Node i holds draft_tokens[i] and hangs under node parents[i] (-1: the root, the round's first input);
    parents come before children. Row 0 of target_logits is the root's, row i+1 node i's. A chain is the
    tree with parents [-1, 0, 1, ...], for which this is greedy_accept. Returns (the accepted nodes along the
    path, next_token).
    """
    _check_rows(np.asarray(target_logits), np.asarray(draft_tokens).shape[0])
    return tree_greedy_accept_choices(draft_tokens, parents, np.argmax(target_logits, axis=-1))


def tree_greedy_accept_choices(draft_tokens: np.ndarray, parents: np.ndarray,
                               target_choice: np.ndarray) -> tuple[list[int], int]:
    """tree_greedy_accept given the target's argmax per row [n+1] instead of its logits."""
    draft_tokens = np.asarray(draft_tokens)  # [n]
    parents = np.asarray(parents)  # [n]
    n = draft_tokens.shape[0]
    target_choice = np.asarray(target_choice)  # [n+1]
    if target_choice.shape != (n + 1,):
        raise ValueError(f"need the target's choice for {n + 1} positions, got shape {target_choice.shape}")
    check_tree(parents)
    path: list[int] = []
    row = 0
    while True:
        children = np.flatnonzero((parents == row - 1) & (draft_tokens == target_choice[row]))
        if children.size == 0:
            return path, int(target_choice[row])
        path.append(int(children[0]))
        row = path[-1] + 1


def tree_speculative_accept(
    draft_tokens: np.ndarray,
    parents: np.ndarray,
    p_draft: np.ndarray | None,
    p_target: np.ndarray,
    rng: np.random.Generator,
) -> tuple[list[int], int]:
    """Lossless sampling over a token tree: recursive rejection sampling (SpecInfer's multi-step speculative
    sampling; Jeon et al. 2024 for siblings drawn without replacement).

    At a node, its children are tried in order against the node's target row p: child x, drawn from q, is
    accepted with probability min(1, p(x)/q(x)); the walk then continues below it with that child's own row.
    On a rejection p becomes residual(p, q) and the next sibling is tried; when every child is rejected the
    token is drawn from the last p. Each stage emits a token distributed as its p whatever the later stages
    do (the residual is exactly the mass the stage left), so the output is distributed as p_target.

    That holds when row i of `p_draft` [n, vocab] is the distribution node i was drawn from *given its
    ancestors and its earlier siblings*: for siblings drawn without replacement from q, q with the earlier
    siblings' tokens removed and renormalised (sampling.sample_distinct returns those rows). None: every node
    is deterministic (top-k picks, lookups), a one-hot stage, exact for any choice of tokens. A node with
    q(x) == 0 is skipped: it cannot have come from its row, and skipping a stage leaves p's law intact.

    Row 0 of p_target [n+1, vocab] is the root's, row i+1 node i's. Returns (accepted nodes, next token).
    """
    draft_tokens = np.asarray(draft_tokens)  # [n]
    parents = np.asarray(parents)  # [n]
    n = draft_tokens.shape[0]
    p_target = np.asarray(p_target)  # [n+1, vocab]
    _check_rows(p_target, n)
    check_tree(parents)
    if p_draft is not None:
        p_draft = check_p_draft(p_draft, n, p_target.shape[1])  # [n, vocab]
    path: list[int] = []
    row = 0
    while True:
        p = np.asarray(p_target[row], dtype=np.float64)  # [vocab] this stage's law
        for child in np.flatnonzero(parents == row - 1):
            x = int(draft_tokens[child])
            if p_draft is None:
                q = np.zeros_like(p)  # [vocab]
                q[x] = 1.0
            else:
                q = p_draft[child]  # [vocab]
            if q[x] <= 0.0:
                continue
            if rng.random() * q[x] < p[x]:
                path.append(int(child))
                row = int(child) + 1
                break
            p = residual(p, q)
        else:
            return path, sample(p, rng)


def check_p_draft(p_draft: np.ndarray, n: int, vocab: int) -> np.ndarray:
    """A drafter's p_draft as the acceptance rule needs it: [n, vocab], each row a distribution. Anything else
    would not fail loudly but bias every accepted token (a ratio against a wrong law), so it is refused here.
    Costs one pass over the rows, small beside the verification forward that produced p_target."""
    p_draft = np.asarray(p_draft)
    if p_draft.shape != (n, vocab):
        raise SpecdecError(f"the drafter's p_draft has shape {p_draft.shape}, expected {(n, vocab)}: one row per "
                           "draft token over the target's vocabulary")
    if n:
        lowest = p_draft.min()
        sums = p_draft.sum(axis=1)  # [n] pairwise summation: float32 rows stay within ~1e-6 of their sum
        worst = float(np.abs(sums - 1.0).max())
        if not (lowest >= 0.0 and worst <= P_DRAFT_SUM_TOLERANCE):  # written so that NaN fails too
            raise SpecdecError(f"the drafter's p_draft rows are not distributions (smallest entry {lowest:.3g}, "
                               f"row sums {sums.min():.6g}..{sums.max():.6g})",
                               "each row must be the law its token was drawn from: entries >= 0 summing to 1")
    return p_draft


def check_tree(parents: np.ndarray) -> None:
    """parents[i] must be -1 (the root) or an earlier node: the order the verification step lays nodes out in."""
    parents = np.asarray(parents)
    if parents.ndim != 1 or ((parents < -1) | (parents >= np.arange(parents.shape[0]))).any():
        raise ValueError(f"tree parents must be -1 or an earlier node's index, got {parents.tolist()}")


def tree_depths(parents: np.ndarray) -> np.ndarray:
    """Depth of each node below the root (children of the root: 1)."""
    depth = np.zeros(len(parents), dtype=np.int64)  # [n]
    for i, p in enumerate(parents):
        depth[i] = 1 if p < 0 else depth[p] + 1
    return depth


def tree_attention_bias(parents: np.ndarray, past: int, dtype=np.float32) -> np.ndarray:
    """Additive attention bias [1, 1, n+1, past+n+1] of a tree step: every slot (root first) sees the whole past,
    its ancestors and itself; -inf elsewhere, so siblings and cousins never see each other."""
    n = len(parents)
    sees = np.eye(n + 1, dtype=bool)  # [n+1, n+1] slot 0 = root
    sees[1:, 0] = True
    for i, p in enumerate(parents):  # parents precede children: the parent's row is complete
        if p >= 0:
            sees[i + 1] |= sees[p + 1]
    bias = np.zeros((1, 1, n + 1, past + n + 1), dtype=dtype)
    bias[0, 0, :, past:] = np.where(sees, 0.0, -np.inf)
    return bias


def residual(p_target_row: np.ndarray, p_draft_row: np.ndarray) -> np.ndarray:
    """The distribution to draw the correction from after a rejection: norm(max(0, p_target - p_draft)).

    Its mass equals the rejection probability, so it is 0 only when the rows are equal and no
    rejection can happen. If rounding rejects anyway (p_target[x] a hair under p_draft[x] with
    no excess elsewhere), p_target is returned: a valid distribution, on an event of ~0 mass.
    """
    p_target_row = np.asarray(p_target_row, dtype=np.float64)  # [vocab]
    excess = np.maximum(p_target_row - p_draft_row, 0.0)  # [vocab]
    mass = excess.sum()
    if mass > 0.0:
        return excess / mass
    return p_target_row / p_target_row.sum()


def _check_rows(target_rows: np.ndarray, k: int) -> None:
    if target_rows.ndim != 2 or target_rows.shape[0] != k + 1:
        raise ValueError(f"the target must give k+1 = {k + 1} rows [k+1, vocab], got shape {target_rows.shape}")
