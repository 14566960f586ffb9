"""`tandem bench`: workloads, offered load, the client that times each request, reports and plots."""
