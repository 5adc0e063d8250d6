"""gradtx: sparse, lazy, accumulated, stale-aware and mirrored gradient
transformations for JAX, composable with optax."""

from gradtx._accumulate import AccumulateState as AccumulateState
from gradtx._accumulate import accumulate as accumulate
from gradtx._autodiff import LeafSparsity as LeafSparsity
from gradtx._autodiff import SparsityReport as SparsityReport
from gradtx._autodiff import sparse_grad as sparse_grad
from gradtx._autodiff import sparse_labels as sparse_labels
from gradtx._autodiff import sparse_value_and_grad as sparse_value_and_grad
from gradtx._autodiff import sparsity_report as sparsity_report
from gradtx._custom import RowTransformationState as RowTransformationState
from gradtx._custom import row_transformation as row_transformation
from gradtx._fresh_rows import FreshRows as FreshRows
from gradtx._fresh_rows import reset_rows as reset_rows
from gradtx._ids import Words as Words
from gradtx._inputs import Jagged as Jagged
from gradtx._inputs import Keyed as Keyed
from gradtx._inputs import KeyedJagged as KeyedJagged
from gradtx._inputs import pad_batch as pad_batch
from gradtx._jaxpr import SparsityWarning as SparsityWarning
from gradtx._lazy_adam import (
  ScaleByLazyAdamCatchUpState as ScaleByLazyAdamCatchUpState,
)
from gradtx._lazy_adam import ScaleByLazyAdamState as ScaleByLazyAdamState
from gradtx._lazy_adam import lazy_adam as lazy_adam
from gradtx._lazy_adam import lazy_adamw as lazy_adamw
from gradtx._lazy_adam import scale_by_lazy_adam as scale_by_lazy_adam
from gradtx._lookup import lookup as lookup
from gradtx._memory import bytes_per_row as bytes_per_row
from gradtx._memory import reuse_host_memory as reuse_host_memory
from gradtx._memory import use_huge_pages as use_huge_pages
from gradtx._mirrored import AllReduce as AllReduce
from gradtx._mirrored import Mirrored as Mirrored
from gradtx._mirrored import all_reduce as all_reduce
from gradtx._open_vocab import OpenVocab as OpenVocab
from gradtx._open_vocab import OpenVocabState as OpenVocabState
from gradtx._optimizers import FtrlState as FtrlState
from gradtx._optimizers import LazyTraceState as LazyTraceState
from gradtx._optimizers import ScaleByRowwiseRssState as ScaleByRowwiseRssState
from gradtx._optimizers import ScaleByRssState as ScaleByRssState
from gradtx._optimizers import adagrad as adagrad
from gradtx._optimizers import ftrl as ftrl
from gradtx._optimizers import lazy_sgd as lazy_sgd
from gradtx._optimizers import lazy_trace as lazy_trace
from gradtx._optimizers import rowwise_adagrad as rowwise_adagrad
from gradtx._optimizers import scale_by_rowwise_rss as scale_by_rowwise_rss
from gradtx._optimizers import scale_by_rss as scale_by_rss
from gradtx._partial_rowwise_adam import (
  ScaleByPartialRowwiseAdamState as ScaleByPartialRowwiseAdamState,
)
from gradtx._partial_rowwise_adam import (
  partial_rowwise_adam as partial_rowwise_adam,
)
from gradtx._partial_rowwise_adam import (
  scale_by_partial_rowwise_adam as scale_by_partial_rowwise_adam,
)
from gradtx._plan import StackPlan as StackPlan
from gradtx._plan import StackSpec as StackSpec
from gradtx._plan import TableSpec as TableSpec
from gradtx._precision import QuantizedRows as QuantizedRows
from gradtx._precision import stochastic_round as stochastic_round
from gradtx._publish import Delta as Delta
from gradtx._publish import TrackChangesState as TrackChangesState
from gradtx._publish import apply_delta as apply_delta
from gradtx._publish import delta as delta
from gradtx._publish import track_changes as track_changes
from gradtx._sharded import sharded_init as sharded_init
from gradtx._sparse_rows import SparseRows as SparseRows
from gradtx._stack import TableStack as TableStack
from gradtx._staleness import DropStaleState as DropStaleState
from gradtx._staleness import drop_stale as drop_stale
from gradtx._staleness import staleness_stats as staleness_stats
from gradtx._transforms import add_decayed_weights as add_decayed_weights
from gradtx._transforms import apply_updates as apply_updates
from gradtx._transforms import clip_by_global_norm as clip_by_global_norm
from gradtx._transforms import densify as densify
from gradtx._transforms import global_norm as global_norm
from gradtx._transforms import scale as scale
from gradtx._transforms import scale_by_learning_rate as scale_by_learning_rate
from gradtx._vocab import Hashed as Hashed
from gradtx._vocab import VocabState as VocabState

__version__ = "0.1.0"

__all__ = [
  "AccumulateState",
  "AllReduce",
  "Delta",
  "DropStaleState",
  "FreshRows",
  "FtrlState",
  "Hashed",
  "Jagged",
  "Keyed",
  "KeyedJagged",
  "LazyTraceState",
  "LeafSparsity",
  "Mirrored",
  "OpenVocab",
  "OpenVocabState",
  "QuantizedRows",
  "RowTransformationState",
  "ScaleByLazyAdamCatchUpState",
  "ScaleByLazyAdamState",
  "ScaleByPartialRowwiseAdamState",
  "ScaleByRowwiseRssState",
  "ScaleByRssState",
  "SparseRows",
  "SparsityReport",
  "SparsityWarning",
  "StackPlan",
  "StackSpec",
  "TableSpec",
  "TableStack",
  "TrackChangesState",
  "VocabState",
  "Words",
  "accumulate",
  "adagrad",
  "add_decayed_weights",
  "all_reduce",
  "apply_delta",
  "apply_updates",
  "bytes_per_row",
  "clip_by_global_norm",
  "delta",
  "densify",
  "drop_stale",
  "ftrl",
  "global_norm",
  "lazy_adam",
  "lazy_adamw",
  "lazy_sgd",
  "lazy_trace",
  "lookup",
  "pad_batch",
  "partial_rowwise_adam",
  "reset_rows",
  "reuse_host_memory",
  "row_transformation",
  "rowwise_adagrad",
  "scale",
  "scale_by_lazy_adam",
  "scale_by_learning_rate",
  "scale_by_partial_rowwise_adam",
  "scale_by_rowwise_rss",
  "scale_by_rss",
  "sharded_init",
  "sparse_grad",
  "sparse_labels",
  "sparse_value_and_grad",
  "sparsity_report",
  "staleness_stats",
  "stochastic_round",
  "track_changes",
  "use_huge_pages",
]
