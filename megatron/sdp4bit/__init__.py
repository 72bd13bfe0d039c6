"""SDP4Bit: 4-bit communication quantization for sharded data-parallel training.

Layers, each depending only on the ones after it::

    training -> integration -> comm -> quantization

Importing this package installs nothing into megatron-core; see
``megatron.sdp4bit.integration.install_sdp4bit``.
"""

__version__ = "0.2.0"
