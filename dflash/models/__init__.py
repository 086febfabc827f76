"""models: the networks. The frozen target (which model, GGUF conversion, loading, the feature
layer rule: target.py; features and soft labels on packed rows: features.py; the FlexAttention
interface it registers with transformers: flex_interface.py; captured per row
length: target_graph.py; what it hands the drafter: target_output.py), the spec's dtype names
(dtypes), the DFlash drafter (config, layers, export/import and its content check; `dflash
export-check`: export_check.py), the decoder layer's math that the feature extractor and
decode/'s two engines share (layers.py), the one CUDA-graph capture helper (graphs.py), and the
attention masks of packed rows.

May import: the top-level modules (errors, settings), artifacts/ (manifest, cache), spec/. Nothing
from data/, decode/, train/, eval/, runtime/ or stages/.
"""
