"""Graph utilities shared by capture, patterns, passes and verification.

Everything here works on aten-level ``torch.fx`` graphs as produced by :mod:`kopt.capture`:
every node carries a fake tensor (or a Python value) in ``node.meta["val"]``, parameters and
buffers are ``get_attr`` nodes.
"""

from kopt.graph.deps import (
    constant_nodes,
    dependency_sets,
    to_networkx,
)
from kopt.graph.query import (
    CATEGORIES,
    attr,
    bias_add_operands,
    compact_paths,
    describe_node,
    fake_mode_of,
    is_tensor_node,
    is_view,
    module_path,
    module_paths,
    op_category,
    op_name,
    other_operand,
    qualified_name,
    structural_key,
    tensor_meta,
    val,
)
from kopt.graph.splice import (
    add_constant,
    copy_graph_module,
    eliminate_dead,
    fake_call,
    infer_meta,
    inline_graph,
    prune_unused_attributes,
    remove_dead_code,
    stable_topo_sort,
)

__all__ = [
    "CATEGORIES",
    "add_constant",
    "attr",
    "bias_add_operands",
    "compact_paths",
    "describe_node",
    "constant_nodes",
    "copy_graph_module",
    "dependency_sets",
    "eliminate_dead",
    "fake_call",
    "fake_mode_of",
    "infer_meta",
    "inline_graph",
    "is_tensor_node",
    "is_view",
    "module_path",
    "module_paths",
    "op_category",
    "op_name",
    "other_operand",
    "prune_unused_attributes",
    "qualified_name",
    "remove_dead_code",
    "stable_topo_sort",
    "structural_key",
    "tensor_meta",
    "to_networkx",
    "val",
]
