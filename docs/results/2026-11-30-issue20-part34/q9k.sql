select n_name as nation, o_year, sum(s) as sum_profit
from (select nk, o_year, sum(amount) as s
      from (select s_nationkey as nk, extract(year from o_orderdate) as o_year,
                   l_extendedprice * (1 - l_discount) - ps_supplycost * l_quantity as amount
            from part, supplier, lineitem, partsupp, orders
            where s_suppkey = l_suppkey and ps_suppkey = l_suppkey and ps_partkey = l_partkey
              and p_partkey = l_partkey and o_orderkey = l_orderkey
              and p_name like '%green%') as profit
      group by nk, o_year) g, nation
where nk = n_nationkey
group by n_name, o_year order by nation, o_year desc;
