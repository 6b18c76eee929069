"""Worker → sink: the wire format (msgspec headers, CRC-32s), the shared-memory ring the states
travel in, the records that let the next run remove what a killed run left in /dev/shm, and the
rule about cached prefix blocks that the driver and the sink both apply (prefix_blocks.py)."""
