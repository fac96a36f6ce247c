"""The chapters' experiments: per chapter (or per group of real-data chapters) its profile table,
the runs it trains and the tables, facts and figures it shows."""
