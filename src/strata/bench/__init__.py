"""`strata bench`: Strata target-only vs DFlash vs Hugging Face generate vs the bandwidth floor."""
