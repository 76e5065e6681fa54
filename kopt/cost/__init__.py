"""The cost model: what a graph costs on a device, and what each rewrite is predicted to save.

* :mod:`kopt.cost.counts` -- FLOPs, bytes and launches per node, from the graph's metadata.
* :mod:`kopt.cost.symbolic` -- the same counts as sympy expressions of the workload's symbols
  (batch, image/text tokens, sequence length, hidden size), fitted from probe captures.
* :mod:`kopt.cost.device` -- the device model (peak rate per dtype, bandwidth, launch costs,
  efficiencies); :data:`H200` shipped, :func:`fit` to a profiler trace (:mod:`kopt.profile`);
  a :class:`Calibration` (:func:`measure`) keeps what a fit is made of, to fit it again later.
* :mod:`kopt.cost.rank` -- predicted saving per pass (graph before vs after it), the ranking,
  and the gate that skips passes predicted to lose (``kopt.optimize(..., cost=CostModel(...))``).
"""

from kopt.cost.calibrate import Calibration, calibrate, fit, fit_counted, fit_error, measure
from kopt.cost.counts import OpCount, count_graph, count_node
from kopt.cost.device import H200, DeviceModel, Prediction, known_device
from kopt.cost.rank import CostModel, PassPrediction, Ranking

__all__ = [
    "H200",
    "Calibration",
    "CostModel",
    "DeviceModel",
    "OpCount",
    "PassPrediction",
    "Prediction",
    "Ranking",
    "calibrate",
    "count_graph",
    "count_node",
    "fit",
    "fit_counted",
    "fit_error",
    "known_device",
    "measure",
]
