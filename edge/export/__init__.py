"""ONNX export of a drafter, run once per model and not at draft time: the exporter and the quantized rows the ONNX
drafter reads (``onnx_export``), the torch-free writer straight from a GGUF (``gguf_onnx``) and the torch step it
traces otherwise (``torch_step``)."""
