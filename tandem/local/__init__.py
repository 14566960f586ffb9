"""`tandem up`: the whole stack as local processes, started as the operator starts pods."""
