"""The head inputs of the ``segments`` joint reward model (docs/design/algorithms.md#joint-reward-model): each
agent's pooled response features (:func:`segment_features`), projected on their first k principal components
(:func:`segment_projection`), each agent's squared length (:func:`length_squares`) and the products of the agents'
lengths (:func:`length_products`).

A linear head on a·(h+1) standardized features (1,154 for two SmolLM2 agents) fitted on a few hundred joint
responses learns its training pairs (accuracy ~0.98) and much less of the preference on unseen items (0.70–0.83 on
``humaneval_docs``); weight decay and early stopping did not close that gap. Projecting each agent's h pooled
dimensions on the k directions along which the training rows vary most (principal component analysis, Pearson 1901;
Hotelling 1933), scaled to unit variance, and keeping its length feature as it is, leaves a·(k+1) of the head's
weights: principal-component regression (Jolliffe 1982), the textbook remedy for a regression on many correlated
inputs and few examples. Measured on the stored pairs of the cross MARLHF runs: docs/results/marlhf.md.

The head also reads each agent's standardized log length squared (:func:`length_squares`): linear in the log
lengths, a head can only say "longer is better" or "shorter is better", while a preference for a length in a band
(``humaneval_docs`` credits a summary-to-explanation ratio in [2, 6] and word counts in bounds, and falls off on
both sides) is a bump, which the square lets a linear head express
(docs/results/marlhf.md#the-lengths-square-2026-12-03). A preference about the agents' *relative* lengths (the
ratio of the explanation to the summary in a band) is a bump in log l_1 − log l_2, whose square holds the product
log l_1 · log l_2 beside the two squares: with the products of every two agents' standardized log lengths
(:func:`length_products`) the head holds every quadratic form of the lengths
(docs/results/marlhf.md#the-agents-relative-lengths-and-what-bounds-the-held-out-figure-2026-12-07).

Shape legend: n rows, a agents, h hidden size, f = a·(h+1) features, k components per agent, m = a·(k+1) (the
head reads m + a + a(a−1)/2 inputs: the projection, then the squares, then the products).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pbrl.models.threads import one_thread


def segment_features(hidden: torch.Tensor, spans: Sequence[Sequence[tuple[int, int]]]) -> torch.Tensor:
    """Per row and agent: the mean of ``hidden`` over the agent's response positions [start, end) and
    log(1 + end − start); an empty response gives zeros and log 1 = 0.

    Args:
        hidden: (b, t, h) hidden states of right-padded rows.
        spans: per row, one (start, end) per agent (``JointInput.response_spans``), the same count a for all.

    Returns:
        (b, a·(h+1)) features, agent by agent: [mean_1 (h), log-length_1, …, mean_a, log-length_a].
    """
    b, t, _ = hidden.shape
    bounds = torch.tensor([list(row) for row in spans], dtype=torch.long, device=hidden.device)  # (b, a, 2)
    pos = torch.arange(t, device=hidden.device)  # (t,)
    inside = (pos >= bounds[..., :1]) & (pos < bounds[..., 1:])  # (b, a, t)
    counts = inside.sum(-1, keepdim=True)  # (b, a, 1)
    means = torch.einsum("bat,bth->bah", inside.to(hidden.dtype), hidden) / counts.clamp(min=1)  # (b, a, h)
    return torch.cat([means, torch.log1p(counts.to(hidden.dtype))], dim=-1).reshape(b, -1)  # (b, a·(h+1))


# A component whose singular value is below this share of the first one carries no variance of the training rows
# (centred rows have rank <= n - 1, so k >= n leaves some): its column is left 0 rather than scaled by ~1/0, which
# would give an unseen row any score.
MIN_RELATIVE_SINGULAR_VALUE = 1e-6


def segment_projection(standardized: torch.Tensor, num_agents: int, components: int) -> torch.Tensor:
    """The (f, m) projection of standardized ``segments`` features onto each agent's first ``components`` principal
    components (from the SVD of the training rows' (n, h) block; the features are standardized, hence centred on
    those rows), each column scaled so the training rows' projections have unit variance; agent k's length feature
    is passed through. A component without variance on the training rows (singular value below
    :data:`MIN_RELATIVE_SINGULAR_VALUE` of the first) gets a zero column. Signs follow ``torch.linalg.svd``, run on
    one thread (deterministic on one machine whatever torch's thread count); the head's weights absorb them.

    Args:
        standardized: (n, f) standardized features of the distinct training rows, f = a·(h+1) with agent k's block
            at columns k·(h+1) … k·(h+1)+h (pooled hidden state, then log length).
        num_agents: a.
        components: k ≥ 1; components beyond the rank of the rows' block leave their columns 0.

    Raises:
        ValueError: ``components`` < 1, or f is not a multiple of ``num_agents``.
    """
    n, f = standardized.shape
    if components < 1:
        raise ValueError(f"reward_head_components: got {components}; must be >= 1")
    if f % num_agents:
        raise ValueError(f"segments features: {f} columns do not split into {num_agents} agents")
    block = f // num_agents  # h + 1
    width = components + 1
    projection = torch.zeros((f, num_agents * width), dtype=standardized.dtype)
    for k in range(num_agents):
        pooled = standardized[:, k * block : k * block + block - 1].double()  # (n, h)
        with one_thread():  # LAPACK's SVD differs in its last bits with the thread count (pbrl/models/threads.py)
            _, singular, vh = torch.linalg.svd(pooled, full_matrices=False)  # (min(n, h),), (min(n, h), h)
        kept = int((singular[:components] > MIN_RELATIVE_SINGULAR_VALUE * singular[:1].clamp(min=1e-300)).sum())
        basis = vh[:kept].T  # (h, kept)
        spread = singular[:kept] / n**0.5  # population std of the training rows' projections (they are centred)
        rows = slice(k * block, k * block + block - 1)
        projection[rows, k * width : k * width + kept] = (basis / spread).to(standardized.dtype)
        projection[k * block + block - 1, k * width + components] = 1.0  # the length feature, unchanged
    return projection


def length_squares(standardized: torch.Tensor, num_agents: int) -> torch.Tensor:
    """Each agent's standardized length feature squared, (n, a): column k is ``standardized[:, k·(h+1)+h] ** 2``.

    Args:
        standardized: (n, f) standardized ``segments`` features, f = a·(h+1), agent k's log length at column
            k·(h+1)+h.
        num_agents: a.

    Raises:
        ValueError: f is not a multiple of ``num_agents``.
    """
    return _lengths(standardized, num_agents) ** 2  # (n, a)


def length_products(standardized: torch.Tensor, num_agents: int) -> torch.Tensor:
    """The products of every two agents' standardized length features, (n, a(a−1)/2), in the order (1, 2), (1, 3),
    …, (1, a), (2, 3), …: column (i, j) is ``standardized[:, i·(h+1)+h] * standardized[:, j·(h+1)+h]``. One agent:
    (n, 0). Arguments and errors as :func:`length_squares`.
    """
    lengths = _lengths(standardized, num_agents)  # (n, a)
    pairs = torch.triu_indices(num_agents, num_agents, offset=1)  # (2, a(a−1)/2), row-major: (0, 1), (0, 2), …
    return lengths[..., pairs[0]] * lengths[..., pairs[1]]  # (n, a(a−1)/2)


def _lengths(standardized: torch.Tensor, num_agents: int) -> torch.Tensor:
    """Each agent's standardized length feature, (n, a): column k is ``standardized[:, k·(h+1)+h]``.

    Raises:
        ValueError: f is not a multiple of ``num_agents``.
    """
    f = standardized.shape[-1]
    if f % num_agents:
        raise ValueError(f"segments features: {f} columns do not split into {num_agents} agents")
    return standardized[..., f // num_agents - 1 :: f // num_agents]
