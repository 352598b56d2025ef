"""Operations: running federations and daemons as supervised processes."""
