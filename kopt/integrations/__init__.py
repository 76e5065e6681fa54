"""kopt in front of the model an inference engine runs, on the engine's own call path.

* :mod:`kopt.integrations.diffusers` -- ``optimize_pipeline(pipe)``: a diffusers pipeline's
  transformer, optimized on the first real call with the pipeline's own arguments.

Each integration is imported on its own (``from kopt.integrations.diffusers import ...``) so that
``import kopt`` never imports an engine.
"""
