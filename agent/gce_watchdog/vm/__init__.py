"""What every VM-side command shares: config, the console (serial writer, emitter), state."""
