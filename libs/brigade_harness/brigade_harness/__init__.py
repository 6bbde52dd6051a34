"""The local process harness: the whole system on one machine, each service its own process
(`system.LocalSystem`), and the servers it starts (`devservers`: redis-server, a Redis Cluster,
moto's S3). `brigade up`, the benchmarks and the tests share it; it imports only the library."""
