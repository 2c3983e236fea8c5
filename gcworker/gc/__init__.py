"""The collector: small collectors, each with one `run()` and one reason to exist, run in a fixed
order by `gcworker.gc.collection.collect()` under a database fence (rule 11)."""
