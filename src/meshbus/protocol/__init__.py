"""The meshbus wire protocol, sans-IO. See docs/protocol.md for the byte layout."""

from meshbus.protocol.codec import (
    ControlFrame,
    DataFrame,
    Frame,
    FrameDecoder,
    FrameError,
    OversizedFrame,
    check_data_flags,
    decode_body,
    decode_frame,
    describe,
    encode_control,
    encode_data,
    frame_extent,
)
from meshbus.protocol.layout import (
    DEFAULT_MAX_FRAME,
    PROTOCOL_VERSION,
    ControlType,
    DataFlags,
    ErrorCode,
)

__all__ = [
    "DEFAULT_MAX_FRAME",
    "PROTOCOL_VERSION",
    "ControlFrame",
    "ControlType",
    "DataFlags",
    "DataFrame",
    "ErrorCode",
    "Frame",
    "FrameDecoder",
    "FrameError",
    "OversizedFrame",
    "check_data_flags",
    "decode_body",
    "decode_frame",
    "describe",
    "encode_control",
    "encode_data",
    "frame_extent",
]
