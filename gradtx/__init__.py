"""gradtx: sparse, lazy, accumulated, stale-aware and mirrored gradient
transformations for JAX, composable with optax."""

from gradtx._base import SparseRows as SparseRows
from gradtx._sparse import add_decayed_weights as add_decayed_weights
from gradtx._sparse import apply_updates as apply_updates
from gradtx._sparse import clip_by_global_norm as clip_by_global_norm
from gradtx._sparse import densify as densify
from gradtx._sparse import global_norm as global_norm
from gradtx._sparse import lookup as lookup
from gradtx._sparse import scale as scale
from gradtx._sparse import scale_by_learning_rate as scale_by_learning_rate
from gradtx._sparse import sparse_grad as sparse_grad
from gradtx._sparse import sparse_value_and_grad as sparse_value_and_grad

__version__ = "0.1.0"

__all__ = [
  "SparseRows",
  "add_decayed_weights",
  "apply_updates",
  "clip_by_global_norm",
  "densify",
  "global_norm",
  "lookup",
  "scale",
  "scale_by_learning_rate",
  "sparse_grad",
  "sparse_value_and_grad",
]
