// inproc transport: one rank per thread in one process.
