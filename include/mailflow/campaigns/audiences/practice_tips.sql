-- practice_tips (priority 4): active in the window.  Sells nothing.
--
-- Rule: window_start <= last_active_at < window_end, or an assessment with
-- window_start <= started_at < window_end.  The engine runs this campaign last, so
-- users picked by a higher-priority campaign in the same run are already excluded.
-- Caveat: last_active_at is CURRENT (the latest activity ever), so for a re-run of an
-- old window a user who was active then and again later is only found through an
-- assessment started in the window.
--
-- Parameters: window_start, window_end (timestamptz, half-open window [start, end)).
-- The engine adds cooldown / suppression / dedupe exclusions and keyset pagination.
--
-- Columns:
--   user_id      bigint  unique per row
--   email        text
--   first_name   text    may be null or empty
--   recent_kind  text    kind of the latest assessment started in the window (ties: the
--                        highest assessment_id); null if the user only browsed (template: copy)
--
-- Shape: the candidates are the union of two index ranges (users_last_active_at_idx,
-- assessments_started_at_idx), so only they are joined to their latest assessment; an OR over
-- the lateral join would visit every user (~0.7M index probes at 1M users; docs/performance.md).
select u.user_id,
       u.email,
       u.first_name,
       r.kind as recent_kind
from app.users u
left join lateral (
        select a.kind
        from app.assessments a
        where a.user_id = u.user_id
          and a.started_at >= %(window_start)s
          and a.started_at < %(window_end)s
        order by a.started_at desc, a.assessment_id desc
        limit 1
     ) r on true
where u.user_id in (
        select x.user_id
        from app.users x
        where x.last_active_at >= %(window_start)s
          and x.last_active_at < %(window_end)s
        union
        select a.user_id
        from app.assessments a
        where a.started_at >= %(window_start)s
          and a.started_at < %(window_end)s
      )
