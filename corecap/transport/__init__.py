"""Worker → sink: the wire format (msgspec headers, CRC-32s), the shared-memory ring the states
travel in, and the records that let the next run remove what a killed run left in /dev/shm."""
