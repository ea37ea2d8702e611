"""The agent's socket side: hook frames in (server, codec), notices and acks back."""
