-- A histogram of the rollup (jobs_rollup_add): how many values fell in each of its 57
-- buckets, from their bucket numbers (width_bucket over the bounds; 0 below the first).
CREATE OR REPLACE FUNCTION jobs_histogram_of(buckets int[]) RETURNS int[]
LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
    histogram int[] := array_fill(0, ARRAY[57]);
    bucket int;
BEGIN
    FOREACH bucket IN ARRAY COALESCE(buckets, '{}') LOOP
        IF bucket IS NOT NULL THEN
            histogram[bucket + 1] := histogram[bucket + 1] + 1;
        END IF;
    END LOOP;
    RETURN histogram;
END
$$;
