-- Two histograms of the rollup added bucket by bucket, for its upsert.
CREATE OR REPLACE FUNCTION jobs_histogram_add(histogram int[], more int[]) RETURNS int[]
LANGUAGE plpgsql IMMUTABLE STRICT AS $$
BEGIN
    FOR k IN 1 .. cardinality(histogram) LOOP
        IF more[k] <> 0 THEN
            histogram[k] := histogram[k] + more[k];
        END IF;
    END LOOP;
    RETURN histogram;
END
$$;
